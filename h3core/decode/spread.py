"""The decode shared out over the ranks that just denoised: tiles everywhere, audio on the last rank,
the clip blended on rank 0.

`decode_spread(video_vae, audio_vae, latents, group)` runs on every rank of `group` (None: one rank,
which then does every unit: the single-rank decode is this same code), each with the latents (the
World task `h3core.generate.decode_ranks.rank_decode` broadcasts rank 0's first). Then:

2. the video decode's units (`h3core.decode.tiles.VideoTiles`: every window x tile) are shared out
   in contiguous runs, as evenly as the count allows, the first ranks taking the extra ones (the
   last rank also decodes the audio, after its units: rank 0 blends the last window while the audio
   decodes, where audio first made rank 0 wait for the last window's units behind it), then `shift`
   of the last rank's units moved to rank 0 (`Balance`: learnt from the previous decode of the same
   size, so that rank 0's blend and the last rank's audio end together);
3. each rank sends each unit it decoded to rank 0 as it finishes it (point-to-point, in unit order,
   the audio last), while rank 0, its receives posted before it starts, decodes its own;
4. rank 0 blends every unit into the clip (`VideoTiles.assemble`: bitwise diffusers' tiled decode,
   whichever rank ran which unit) and returns the `Decoded`; the other ranks return None.

Memory per rank: its own units' outputs (each [3, 22, 256, 256] float32 at most, the window's
padding frames left out) until rank 0 has them; rank 0 also every other rank's units and the clip
(`h3core.decode.memory.estimate_decode_memory(..., ranks=n)` counts both).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Mapping

from h3core.decode.clip import Decoded, Phase, check_latents, decode_audio, denormalized_video, no_phase, to_pixels
from h3core.decode.tiles import owners, shares

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

    from h3core.decode.load import LoadedVae


@dataclass
class SpreadStats:
    """What one rank did in a spread decode."""

    rank: int
    ranks: int
    units: int
    video_s: float = 0.0
    audio_s: float = 0.0
    shift: int = 0
    """Units rank 0 took over from the last rank (`Balance`)."""
    assembled_s: float = 0.0
    """Rank 0: seconds from its start to the clip blended, before it waited for the audio."""
    last_units_s: float = 0.0
    """Rank 0: the last rank's seconds from its start to its units sent (it sends them with the audio)."""
    last_units: int = 0
    """Rank 0: the last rank's units."""


@dataclass
class Balance:
    """How many video units rank 0 takes over from the last rank, learnt from the previous decode of
    the same size on the same ranks (a batch's prompts and a server's jobs hold their VAEs between
    decodes; the first decode of a size shares the units evenly).

    The last rank decodes the audio after its units and rank 0 blends the clip around its own, so
    with even shares one of them waits for the other. Rank 0 knows when both finished (the last rank
    sends its seconds with the audio): the gap, in the last rank's seconds per unit, halved, is how
    many more units to move (fewer where it is negative). Each decode's answer is averaged with the
    ones before (halving their weight each time), so that a clock's noise of about one unit does not
    swing the shares back and forth. The clip is bitwise the same whichever rank decodes a unit
    (`tests/dist/test_decode_spread.py`), so the shares may follow the clock."""

    estimates: dict[tuple[int, ...], float] = field(default_factory=dict)
    """Per (ranks, video latent shape, audio latent shape): the units to move, not yet rounded."""

    def shift(self, key: tuple[int, ...]) -> int:
        return max(0, round(self.estimates.get(key, 0.0)))

    def learn(self, key: tuple[int, ...], stats: SpreadStats) -> None:
        """After rank 0's decode of `key` (its `SpreadStats`): the estimate for the next one."""
        if stats.ranks < 2 or stats.rank != 0:
            return
        per_unit = stats.last_units_s / stats.last_units if stats.last_units else stats.assembled_s / max(stats.units, 1)
        if per_unit <= 0:
            return
        gap = stats.last_units_s + stats.audio_s - stats.assembled_s  # > 0: rank 0 waited for the audio
        seen = max(0.0, stats.shift + gap / (2 * per_unit))
        self.estimates[key] = (self.estimates[key] + seen) / 2 if key in self.estimates else seen


def decode_spread(
    video_vae: "LoadedVae", audio_vae: "LoadedVae", latents: Mapping[str, "torch.Tensor"], group: "dist.ProcessGroup | None",
    where: str = "the latents", on_phase: Phase = no_phase, shift: int = 0,
) -> tuple[Decoded | None, SpreadStats]:
    """Decode `latents` (the same on every rank of `group`) over those ranks (module docstring): rank 0
    gets the clip, every rank its `SpreadStats`. `shift` (the same on every rank): units moved from the
    last rank to rank 0 (`Balance`)."""
    import torch
    import torch.distributed as dist

    from h3core.decode.tiles import VideoTiles
    from h3core.runtime import cpu_memory
    from h3core.runtime.device import synchronize

    rank, size = (0, 1) if group is None else (dist.get_rank(group), dist.get_world_size(group))
    device = video_vae.device
    geometry = check_latents(latents, where)
    video_latent, audio_latent = latents["video"], latents["audio"]
    started = time.perf_counter()
    with torch.inference_mode():
        z = denormalized_video(video_vae, video_latent)
        tiles = VideoTiles.of(video_vae.model, *z.shape[2:])
        shift = max(0, min(shift, len(shares(tiles.count, size)[-1]))) if size > 1 else 0  # what the last rank has to give
        mine = shares(tiles.count, size, shift)[rank]
        stats = SpreadStats(rank=rank, ranks=size, units=len(mine), shift=shift)
        audio = None
        if size == 1:  # one rank: the audio first, so that its peak is not on top of the clip
            on_phase("decoding the audio")
            audio = decode_audio(audio_vae, audio_latent)
            synchronize(device)
            stats.audio_s = time.perf_counter() - started
            if device.type == "cpu":  # the audio's freed blocks (other sizes than the video's) go back to the system first
                cpu_memory.release()
        on_phase("decoding the video")
        if rank != 0:
            _decode_and_send(tiles, video_vae.model, z, mine, stats, group)
            stats.video_s = time.perf_counter() - started
            if rank == size - 1:
                _decode_and_send_audio(audio_vae, audio_latent, stats, group)
            return None, stats
        units = _RankZeroUnits(tiles, video_vae.model, z, size, group, geometry.decoded_samples, stats.shift)
        video = to_pixels(tiles.assemble(units, like=z))
        synchronize(device)
        stats.assembled_s = time.perf_counter() - started
        audio, audio_s = units.audio(audio, stats)
        synchronize(device)
    stats.video_s = time.perf_counter() - started - (stats.audio_s if size == 1 else 0.0)
    return Decoded(geometry=geometry, video=video.cpu(), audio=audio.cpu(), seconds={"video": stats.video_s, "audio": audio_s}), stats


class _RankZeroUnits:
    """Rank 0's source of units for `VideoTiles.assemble`: its own, decoded when asked for; the
    others', received into buffers posted one window ahead (so they arrive while rank 0 works).
    Each sender's messages are received in its own order: its units, then (the last rank) the audio."""

    def __init__(self, tiles, model, z, size: int, group, audio_samples: int, shift: int):  # type: ignore[no-untyped-def]
        self.tiles, self.model, self.z, self.group = tiles, model, z, group
        self.owner = owners(tiles.count, size, shift)
        self.size, self.audio_samples = size, audio_samples
        self.posted: dict[int, tuple["torch.Tensor", object]] = {}
        self.next_window = 0
        self._post_window()

    def _post_window(self) -> None:
        import torch
        import torch.distributed as dist

        if self.next_window >= self.tiles.windows:
            return
        for k in self.tiles.window_units(self.next_window):
            if self.owner[k] != 0:
                buffer = torch.empty(self.tiles.unit_shape(), dtype=self.z.dtype, device=self.z.device)
                self.posted[k] = (buffer, dist.irecv(buffer, src=dist.get_global_rank(self.group, self.owner[k]), group=self.group))
        self.next_window += 1

    def __call__(self, k: int) -> "torch.Tensor":
        window = self.tiles.where(k)[0]
        if k == self.tiles.window_units(window).start:
            self._post_window()  # the next window's, while this one is stitched
        if self.owner[k] == 0:
            return self.tiles.unit(self.model, self.z, k)
        buffer, handle = self.posted.pop(k)
        handle.wait()  # type: ignore[attr-defined]
        return buffer

    def audio(self, own: "torch.Tensor | None", stats: SpreadStats) -> tuple["torch.Tensor", float]:
        """The audio and its seconds: rank 0's own (one rank), else received from the last rank with
        its seconds (the audio's, and its units') into rank 0's `stats`."""
        import torch
        import torch.distributed as dist

        if own is not None:
            return own, stats.audio_s
        src = dist.get_global_rank(self.group, self.size - 1)
        audio = torch.empty((2, self.audio_samples), dtype=torch.float32, device=self.z.device)
        seconds = torch.zeros(2, dtype=torch.float64, device=self.z.device)
        dist.recv(audio, src=src, group=self.group)
        dist.recv(seconds, src=src, group=self.group)
        stats.audio_s, stats.last_units_s = (float(x) for x in seconds.tolist())
        stats.last_units = self.owner.count(self.size - 1)
        return audio, stats.audio_s


def _decode_and_send(tiles, model, z, mine: range, stats: SpreadStats, group) -> None:  # type: ignore[no-untyped-def]
    """A rank other than 0: decode each of its units and send it to rank 0 as it is done (held until
    rank 0 has it; every send complete on return)."""
    import torch.distributed as dist

    from h3core.runtime.device import synchronize

    dst = dist.get_global_rank(group, 0)
    pending = []
    for k in mine:
        out = tiles.unit(model, z, k)
        pending.append((out, dist.isend(out, dst=dst, group=group)))
    for _, handle in pending:
        handle.wait()
    synchronize(z.device)


def _decode_and_send_audio(audio_vae, latent, stats: SpreadStats, group) -> None:  # type: ignore[no-untyped-def]
    """The last rank, its units sent (their memory free): decode the audio and send it to rank 0 with its seconds."""
    import torch
    import torch.distributed as dist

    from h3core.runtime import cpu_memory
    from h3core.runtime.device import synchronize

    if latent.device.type == "cpu":  # the units' freed blocks (other sizes than the audio's) go back to the system first
        cpu_memory.release()
    started = time.perf_counter()
    audio = decode_audio(audio_vae, latent)
    synchronize(audio.device)
    stats.audio_s = time.perf_counter() - started
    dst = dist.get_global_rank(group, 0)
    dist.send(audio.contiguous(), dst=dst, group=group)
    dist.send(torch.tensor([stats.audio_s, stats.video_s], dtype=torch.float64, device=audio.device), dst=dst, group=group)
