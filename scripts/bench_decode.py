#!/usr/bin/env python3
"""The decode shared out over Gloo ranks against one rank, measured side by side in one run (issue 35.3).

Both arms run `h3core.generate.decode_ranks.rank_decode`, the task `h3 generate` runs after denoising, on the
synthetic VAEs at a many-tile size (default 864x480, 39 frames: 2 windows x 3 x 5 tiles = 30 units),
every rank at ONE intra-op thread: (a) 2 spawned Gloo ranks, rank 0 taking over as many of the last
rank's units as its `Balance` learnt from the previous decode (the last rank also decodes the audio);
(b) the same ranks with even shares (the first decode of a size, and `h3 generate`'s one prompt);
(c) one rank (in this process). The VAEs are loaded by a first, untimed call (held between calls,
as a batch holds them; that call is also the one (a) first learns from). The arms alternate, the
order reversed every round, so that drift on a shared machine hits them alike; each time is rank 0's
decode (its clock from the start to the blended clip and the audio) and this process's wall time
around `World.run` (rank 0 encoding the mp4 and the preview included, as in `h3 generate`), median of
`--repeat`; the ratios are one rank's over the ranks'. Every run's float32 clip is checked identical
to the one-rank clip (the sha256 of its bytes, taken on rank 0).

    python scripts/bench_decode.py --repeat 5
    python scripts/bench_decode.py --ranks 3 --width 512 --height 512 --frames 39
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from h3core.decode.sources import choose_vaes
from h3core.generate.decode_ranks import HELD_BALANCE, decode_run, rank_decode
from h3core.media import SPATIAL_STRIDE, audio_latents, latent_frames
from h3core.runtime.world import World


def latents(width: int, height: int, frames: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    video = torch.randn(24, latent_frames(frames), height // SPATIAL_STRIDE, width // SPATIAL_STRIDE, generator=g)
    return {"video": video, "audio": torch.randn(2, 32, audio_latents(frames), generator=g)}


def one_thread_decode(ctx, vaes, given):  # type: ignore[no-untyped-def]
    """`rank_decode` at one intra-op thread on this rank (a World task)."""
    torch.set_num_threads(1)
    return rank_decode(ctx, vaes, given)


def even_decode(ctx, vaes, given):  # type: ignore[no-untyped-def]
    """`one_thread_decode` with even shares: rank 0's learnt `Balance` set aside for this call (and
    what this call learns dropped), so the balanced arm keeps learning from its own runs only."""
    saved = ctx.held.pop(HELD_BALANCE, None)
    try:
        return one_thread_decode(ctx, vaes, given)
    finally:
        ctx.held.pop(HELD_BALANCE, None)
        if saved is not None:
            ctx.held[HELD_BALANCE] = saved


def timed(world: World, vaes, given, task=one_thread_decode) -> tuple[dict[str, float], str, list[int]]:  # type: ignore[no-untyped-def]
    """One decode on `world`: the seconds of the decode (rank 0's clock from its start to the blended
    clip, the other ranks' work and the transfers included) and of the whole `World.run` (rank 0's
    mp4 and preview too), the sha256 of rank 0's float32 clip, each rank's units."""
    started = time.perf_counter()
    parts = world.run(task, vaes, given)
    seconds = {"total": time.perf_counter() - started, "decode": decode_run(parts, "cpu").decode_s}
    assert parts[0].clip is not None
    return seconds, parts[0].clip.checksums["video"].sha256, [p.stats.units for p in parts]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--width", type=int, default=864)
    parser.add_argument("--height", type=int, default=480)
    parser.add_argument("--frames", type=int, default=39)
    parser.add_argument("--repeat", type=int, default=5)
    opts = parser.parse_args()
    given, vaes = latents(opts.width, opts.height, opts.frames), choose_vaes(None, None)
    threads = torch.get_num_threads()
    with World(opts.ranks, "cpu") as many, World(1, "cpu") as one:
        torch.set_num_threads(1)
        _, reference, _ = timed(one, vaes, given)  # loads the VAEs (held), untimed
        _, clip, _ = timed(many, vaes, given)  # the balanced arm's first lesson
        if clip != reference:
            raise SystemExit("the spread decode differs from the one-rank decode")
        arms = {"balanced": (many, one_thread_decode), "even": (many, even_decode), "one": (one, one_thread_decode)}
        times: dict[str, dict[str, list[float]]] = {arm: {"decode": [], "total": []} for arm in arms}
        units: dict[str, list[list[int]]] = {arm: [] for arm in arms}
        for i in range(opts.repeat):
            for arm in (list(arms) if i % 2 == 0 else list(reversed(arms))):
                seconds, clip, split = timed(arms[arm][0], vaes, given, arms[arm][1])
                if clip != reference:
                    raise SystemExit(f"run {i} ({arm}) differs from the one-rank decode")
                units[arm].append(split)
                for kind, value in seconds.items():
                    times[arm][kind].append(value)
        torch.set_num_threads(threads)
    print(f"decode {opts.width}x{opts.height}, {opts.frames} frames, synthetic VAEs, 1 thread per rank, {opts.ranks} Gloo ranks against 1")
    print(f"  units per rank, balanced: {units['balanced']}; even: {units['even'][0]}")
    for kind, what in (("decode", "the decode (tiles, audio, transfers, blend: rank 0's clock)"), ("total", "World.run (+ rank 0's mp4 and preview)")):
        single = statistics.median(times["one"][kind])
        print(f"  {what}:")
        print(f"    1 rank:             median {single:.3f}s of {['%.3f' % t for t in times['one'][kind]]}")
        for arm in ("balanced", "even"):
            ranks = statistics.median(times[arm][kind])
            rounds = statistics.median(o / r for o, r in zip(times["one"][kind], times[arm][kind]))
            print(f"    {opts.ranks} ranks, {arm:8s}: median {ranks:.3f}s of {['%.3f' % t for t in times[arm][kind]]}"
                  f" -> 1 rank / {opts.ranks} ranks {single / ranks:.2f}x (rounds' median {rounds:.2f}x)")
    print("  every clip bitwise the one-rank clip (sha256 of its float32 bytes)")


if __name__ == "__main__":
    main()
