"""The decode shared out over spawned Gloo ranks (`h3core.decode.spread`) is bit for bit the one-rank
tiled decode: diffusers' own `AutoencoderKLMiniMaxH3.decode` of the synthetic VAE, computed on rank 0
at the ranks' thread count, at a size of 2 windows x 2 x 2 tiles (8 units: window 0's fall on two
ranks at 3 ranks), and with units moved from the last rank to rank 0 (`Balance`'s shift, broadcast
by the World task). A rank that sends its units out of order, and a blend with its ramps swapped, are
both caught."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import pytest
import torch

import h3core.generate.decode_ranks as ranks
import h3core.decode.spread as spread
import h3core.decode.tiles as tiles
from h3core.decode.run import decode_audio, decode_video
from h3core.decode.sources import choose_vaes
from h3core.reports.schema import TensorChecksum

LATENT = (24, 12, 18, 22)  # 288 x 352 px: 2 x 2 tiles of 256 px; 12 latent frames: 2 windows
REFERENCE = "test: the one-rank decode"  # rank 0 keeps it in `held` for the next tests


def _latents() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(35)
    return {"video": torch.randn(*LATENT, generator=g), "audio": torch.randn(2, 32, 65, generator=g)}


@contextmanager
def _mutated(mutation: str | None) -> Iterator[None]:
    """While inside: this rank sends its units last first (`reversed`: rank 0 expects them in order),
    or blends with the two ramps swapped (`ramps`); nothing with None."""
    real_shares, real_weights = spread.shares, tiles.blend_weights
    if mutation == "reversed":
        spread.shares = lambda units, ranks, shift=0: [s if r == 0 else s[::-1] for r, s in enumerate(real_shares(units, ranks, shift))]  # type: ignore[assignment]
    elif mutation == "ramps":
        tiles.blend_weights = lambda extent, like: real_weights(extent, like)[::-1]  # type: ignore[assignment]
    try:
        yield
    finally:
        spread.shares, tiles.blend_weights = real_shares, real_weights


def _spread_against_one_rank(ctx, size: int, mutation: str | None = None, shift: int = 0):  # type: ignore[no-untyped-def]
    sub = ctx.first_ranks(size)
    if sub is None:
        return None
    latents = _latents()
    decoders, _ = ranks.held_decoders(sub, choose_vaes(None, None))
    with _mutated(mutation):
        decoded, stats = spread.decode_spread(decoders.video, decoders.audio, latents, sub.group, shift=shift)
        task = None
        if mutation is None:  # the World task: rank 0's latents and its Balance's shift broadcast
            key = (size, *latents["video"].shape, *latents["audio"].shape)
            sub.held[ranks.HELD_BALANCE] = spread.Balance({key: float(shift)})
            task = ranks.rank_decode(sub, choose_vaes(None, None), latents if sub.rank == 0 else None)
            sub.held.pop(ranks.HELD_BALANCE)
    if sub.rank != 0:
        return {"units": stats.units, "task_units": task and task.stats.units}
    if REFERENCE not in sub.held:
        sub.held[REFERENCE] = decode_video(decoders.video, latents["video"]), decode_audio(decoders.audio, latents["audio"])
    video, audio = sub.held[REFERENCE]
    return {
        "units": stats.units, "task_units": task and task.stats.units,
        "video": torch.equal(decoded.video, video), "audio": torch.equal(decoded.audio, audio),
        "max_abs": float((decoded.video - video).abs().max()), "shape": tuple(decoded.video.shape),
        "task": task is None or task.clip.checksums["video"].sha256 == TensorChecksum.of(video).sha256,
    }


@pytest.mark.parametrize(("size", "shift"), [(2, 0), (3, 0), (2, 3), (3, 1)])
def test_the_spread_decode_is_the_one_rank_decode_bit_for_bit(world8, size, shift):
    results = world8.run(_spread_against_one_rank, size, None, shift)[:size]
    lead = results[0]
    assert lead["shape"] == (3, 39, 288, 352)
    assert lead["video"] and lead["audio"] and lead["task"], f"max abs {lead['max_abs']}"
    expected = [len(s) for s in spread.shares(8, size, shift)]
    assert [r["units"] for r in results] == [r["task_units"] for r in results] == expected
    assert expected[0] == len(spread.shares(8, size)[0]) + shift  # rank 0 took `shift` of the last rank's units
    assert all(r["units"] > 0 for r in results)  # every rank decoded tiles


@pytest.mark.parametrize("mutation", ["reversed", "ramps"])
def test_a_wrong_assignment_or_blend_is_caught(world8, mutation):
    lead = world8.run(_spread_against_one_rank, 2, mutation)[0]
    assert not lead["video"] and lead["max_abs"] > 1e-3
