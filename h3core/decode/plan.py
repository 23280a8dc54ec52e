"""The decode a generate run ends with, decided and checked before any rank starts.

`plan_decode` picks both VAEs (`choose_vaes`: flag > variable > beside the transformer > the
synthetic VAEs, which only a synthetic transformer may fall back to: real latents through a random
VAE would be noise that looks like a result), reads their headers (each is that VAE, its widths),
and checks that the decode fits the device it runs on (`estimate_decode_memory` of those widths
against this machine's capacity, the transformer's resident bytes beside it where the decode
shares the GPU with a held pipeline: `h3 generate --prompts`). A VAE that is missing, wrong or too
big is one line before the transformer loads, not after the denoising finished. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from h3core.decode.geometry import LatentGeometry, geometry_for
from h3core.decode.memory import AudioDecoderSize, DecodeMemory, VideoDecoderSize, estimate_decode_memory
from h3core.decode.sources import VaeChoice, choose_vaes
from h3core.decode.vae_files import Role, find_vae_files

NO_DECODE = "--no-decode (then `h3 decode LATENTS` where a GPU has room)"


@dataclass(frozen=True)
class DecodePlan:
    """Both VAEs of a run's decode, checked, and what the decode needs."""

    vaes: dict[Role, VaeChoice]
    geometry: LatentGeometry
    memory: DecodeMemory

    def output_bytes(self) -> int:
        from h3core.decode.run import output_bytes

        return output_bytes(self.geometry, save_decoded=False)


def plan_decode(
    video_vae: Path | None, audio_vae: Path | None, model_path: Path | None, *, synthetic_transformer: bool,
    width: int, height: int, frames: int, device: str, beside_bytes: int = 0, ranks: int = 1,
) -> DecodePlan:
    """Choose and check both VAEs for a `width` x `height`, `frames`-frame clip decoded on `device`
    over `ranks` ranks (`beside_bytes`: what else stays on each rank's device meanwhile);
    `ConfigError` / `CheckpointError` / `ResourceLimit` as one line."""
    from h3core.decode.load import vae_config
    from h3core.decode.synthetic import synthetic_vae_file

    vaes = choose_vaes(video_vae, audio_vae, model_path, allow_synthetic=synthetic_transformer)
    configs = {}
    for role, choice in vaes.items():
        path = choice.path if choice.path is not None else synthetic_vae_file(role)[0]
        files = find_vae_files(path, role, choice.source)
        configs[role] = vae_config(files, str(path))
    geometry = geometry_for(width, height, frames)
    memory = estimate_decode_memory(width, height, frames, video=VideoDecoderSize.of(configs["video"]), audio=AudioDecoderSize.of(configs["audio"]), ranks=ranks,
                                    device=device)
    check_decode_memory(memory, geometry, device, beside_bytes)
    return DecodePlan(vaes=vaes, geometry=geometry, memory=memory)


def check_decode_memory(memory: DecodeMemory, geometry: LatentGeometry, device: str, beside_bytes: int = 0) -> None:
    """Refuse (one line) a decode this machine cannot hold: on CUDA each rank's GPU the VAEs and that
    rank's share (the largest rank, `beside_bytes` already there); on a CPU every rank's together,
    out of one pool; the decoded clip and the mp4 in host memory."""
    from h3core.runtime.limits import MemoryNeed, capacity, check_memory

    ranks, what = memory.ranks, f"--width/--height/--frames, or {NO_DECODE}"
    per_rank = memory.rank_bytes if device == "cpu" else [memory.total_bytes]  # a CPU's ranks share one pool
    weights = memory.weights_bytes * len(per_rank)
    on_device = {"VAE weights": weights, "decode activations": sum(per_rank) - weights}
    if beside_bytes:
        on_device["the transformer held beside it"] = beside_bytes * len(per_rank)
    clip = 4 * (3 * geometry.frames * geometry.width * geometry.height + 2 * geometry.decoded_samples)
    on_host = {"decoded clip": clip + geometry.frames * geometry.width * geometry.height * 3}  # + the uint8 frames the encoder takes
    if device == "cuda":
        check_memory(MemoryNeed(ranks=ranks, device=device, on_device=on_device, spawned=False), capacity(device, ranks), what, host_part=False)
        on_device = {}
    check_memory(MemoryNeed(ranks=1, device=device, on_device=on_device, on_host=on_host, spawned=False), capacity(device, ranks), what, device_part=False)
