"""The decode as a World task: `rank_decode` on every rank of a run after its denoising
(`h3 generate`, each prompt of `h3 generate --prompts`), the VAEs held on each rank between calls,
and `decode_run`, the ranks' parts as one `DecodeRun` for the launching process to stage."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping

from h3core.decode.run import ClipLabel, DecodeRun, Decoders, EncodedClip, RankMemory, encode_clip
from h3core.decode.spread import Balance, SpreadStats, decode_spread
from h3core.parallel.collectives import broadcast_tensors

if TYPE_CHECKING:
    import torch

    from h3core.decode.report import VaeInfo
    from h3core.decode.sources import VaeChoice
    from h3core.decode.vae_files import Role
    from h3core.runtime.context import RankContext

HELD_VAES = "vaes"
"""The key of a rank's loaded VAEs in `RankContext.held`: (which VAEs on which device, `Decoders`)."""

HELD_BALANCE = "decode balance"
"""The key of rank 0's `Balance` in `RankContext.held` (learnt with, and dropped with, the held VAEs)."""


@dataclass
class RankDecode:
    """One rank's part of a decode, as `world.run(rank_decode, ...)` returns it (small: rank 0's clip
    comes back as the bytes of its files)."""

    rank: int
    load_s: float
    """Loading the VAEs for this call (0 when the rank held them)."""
    memory: RankMemory
    stats: SpreadStats
    clip: EncodedClip | None = None
    """Rank 0's clip, encoded (None on the others)."""
    video_vae: "VaeInfo | None" = None
    audio_vae: "VaeInfo | None" = None


def held_decoders(ctx: "RankContext", vaes: "Mapping[Role, VaeChoice]") -> tuple[Decoders, float]:
    """This rank's loaded VAEs for `vaes` and the seconds loading them cost now (0 when held: a batch's
    later prompts, a server's later jobs)."""
    key = (tuple((role, str(choice.path), choice.found_by) for role, choice in sorted(vaes.items())), str(ctx.device))
    held = ctx.held.get(HELD_VAES)
    if held is not None and held[0] == key:
        return held[1], 0.0
    drop_decoders(ctx)
    decoders = Decoders.load(vaes, ctx.device)
    ctx.held[HELD_VAES] = (key, decoders)
    return decoders, decoders.load_s


def hold_decoders(ctx: "RankContext", vaes: "Mapping[Role, VaeChoice]") -> None:
    """Load `vaes` on this rank and keep them (`held_decoders`; a World task on every rank: a server
    loads them when it starts, so that its first job pays no load)."""
    held_decoders(ctx, vaes)


def drop_decoders(ctx: "RankContext") -> None:
    """Release this rank's held VAEs, if any (a World task on every rank)."""
    held = ctx.held.pop(HELD_VAES, None)
    ctx.held.pop(HELD_BALANCE, None)
    if held is not None:
        held[1].release()


def rank_decode(
    ctx: "RankContext", vaes: "Mapping[Role, VaeChoice]", latents: Mapping[str, "torch.Tensor"] | None, label: ClipLabel | None = None,
) -> RankDecode:
    """The decode of rank 0's `latents` on every rank of `ctx` (a World task; module docstring), the
    VAEs held on each rank for the next call; rank 0 encodes the clip (`encode_clip`, `label`)."""
    import torch

    from h3core.runtime.device import current_memory_bytes, peak_memory_bytes, release_memory, reset_peak_memory

    release_memory(ctx.device.type)  # what denoising left cached is the decode's to use
    decoders, load_s = held_decoders(ctx, vaes)
    reset_peak_memory(ctx.device)
    start = current_memory_bytes(ctx.device)
    balance = ctx.held.setdefault(HELD_BALANCE, Balance())  # rank 0's decides the shares; the other ranks' stay unused
    key = (ctx.world_size, *latents["video"].shape, *latents["audio"].shape) if ctx.rank == 0 and latents is not None else None
    sent = [latents["video"], latents["audio"], torch.tensor([balance.shift(key)])] if key is not None else None
    video, audio, shift = broadcast_tensors(sent, src=0, group=ctx.group, device=ctx.device)  # a torchrun rank has only its own outcome
    decoded, stats = decode_spread(decoders.video, decoders.audio, {"video": video, "audio": audio}, ctx.group, shift=int(shift.item()))
    if key is not None:
        balance.learn(key, stats)
    memory = RankMemory(peak=peak_memory_bytes(ctx.device), start=start)
    if decoded is None:
        return RankDecode(ctx.rank, load_s, memory, stats)
    clip = encode_clip(decoded, label or ClipLabel(), decoders.video.info.synthetic or decoders.audio.info.synthetic)
    return RankDecode(ctx.rank, load_s, memory, stats, clip, decoders.video.info, decoders.audio.info)


def decode_run(parts: "list[RankDecode]", device: str) -> DecodeRun:
    """The ranks' parts of one decode as one `DecodeRun` (rank 0's clip; the slowest rank's load)."""
    lead = parts[0]
    assert lead.clip is not None and lead.video_vae is not None and lead.audio_vae is not None
    seconds = lead.stats.video_s + (lead.stats.audio_s if lead.stats.ranks == 1 else 0.0)  # rank 0 waits for every other rank
    return DecodeRun(lead.clip, lead.video_vae, lead.audio_vae, device, max(p.load_s for p in parts), [p.memory for p in parts], seconds,
                     [p.stats.units for p in parts] if len(parts) > 1 else [])
