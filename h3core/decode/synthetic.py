"""The embedded synthetic VAEs: H3's two VAEs at small widths, written in the Comfy layout, cached.

With no VAE given, h3 decodes with these, through the same loaders as the real files (every report
and preview says `synthetic`). They have the real structure -- 24 and 32 latent channels, the video
VAE's 6 encoder levels, 16x/4x compression, 17-frame clips, 64-wide ViT heads, registers and tiled
decode; the audio VAE's DAC strides (800 samples per latent), 8-head attention projection, BigVGAN
rates, kernels and AMP blocks at 32 kHz -- with narrow channels and 2 ViT blocks, so a tiny latent
decodes in well under a second on a CPU. The latent statistics are MiniMax's published ones.

The weights are deterministic from the seed: each tensor is drawn from its own generator seeded by
(seed, tensor name), in diffusers' layout, then written as the Comfy files are: the video VAE in the
original module names in float16 (`minimax_h3_video_vae_fp16`), the audio VAE folded, float32
(`minimax_h3_audio_vae_fp32`). The values are rounded to what the file stores first, so
`synthetic_state_dict` is exactly what the file holds (the tests' diffusers reference loads it).
"""

from __future__ import annotations

import errno
import hashlib
import json
import zlib
from pathlib import Path
from typing import TYPE_CHECKING

from h3core import settings
from h3core.decode import audio_vae, video_vae
from h3core.decode.vae_files import Role
from h3core.errors import CheckpointError
from h3core.files.paths import free_bytes, os_error_reason

if TYPE_CHECKING:
    import torch

GENERATOR_VERSION = "1"
"""Bump when the synthetic weights change, to invalidate caches."""
SEED = 0

SYNTHETIC_VIDEO_CONFIG: dict[str, object] = {
    **video_vae.STRUCTURE,
    "latent_channels": 24,
    "block_out_channels": (32, 32, 32, 32, 32, 32),
    "layers_per_block": 1,
    "decoder_num_layers": 2,
    "decoder_num_attention_heads": 2,
    "decoder_num_register_tokens": 4,
    "decoder_ffn_mult": 4,
    "latents_mean": list(video_vae.PUBLISHED_LATENTS_MEAN),
    "latents_std": list(video_vae.PUBLISHED_LATENTS_STD),
}
SYNTHETIC_AUDIO_CONFIG: dict[str, object] = {
    **audio_vae.STRUCTURE,
    "encoder_dim": 4,
    "encoder_rates": (2, 4, 4, 5, 5),
    "latent_dim": 64,
    "latent_channels": 32,
    "decoder_dim": 128,
    "latents_mean": list(audio_vae.PUBLISHED_LATENTS_MEAN),
    "latents_std": list(audio_vae.PUBLISHED_LATENTS_STD),
}
CONFIGS: dict[Role, dict[str, object]] = {"video": SYNTHETIC_VIDEO_CONFIG, "audio": SYNTHETIC_AUDIO_CONFIG}
FILE_DTYPES = {"video": "float16", "audio": "float32"}
COMFY_NAMES = {"video": "minimax_h3_video_vae_fp16", "audio": "minimax_h3_audio_vae_fp32"}


def _generator(seed: int, name: str) -> "torch.Generator":
    import torch

    return torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))


def _value(name: str, shape: tuple[int, ...], seed: int) -> "torch.Tensor":
    """A deterministic value for one parameter, scaled so activations stay O(1)."""
    import torch

    noise = torch.randn(shape, generator=_generator(seed, name))
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "bias" or name.endswith(("q_bias", "v_bias")):
        return 0.02 * noise
    if leaf in ("scale1", "scale2"):
        return 0.5 + 0.1 * noise  # non-zero: every ViT block contributes
    if leaf == "alpha" and len(shape) == 3:
        return 1.0 + 0.1 * noise  # Snake's frequency (linear scale, must stay positive)
    if leaf in ("alpha", "beta"):
        return 0.1 * noise  # SnakeBeta's, in log scale
    if leaf == "register_tokens":
        return noise
    if leaf == "weight_g":
        scale = 0.01 if name.startswith("decoder.conv_post.") else 1.0  # keeps the noise inside [-1, 1]: no clipping
        return scale * (1.0 + 0.1 * noise)
    if leaf == "weight" and (".norm" in name or len(shape) == 1):
        return 1.0 + 0.1 * noise
    if len(shape) >= 2:
        fan_in = 1
        for size in shape[1:]:
            fan_in *= size
        return noise / fan_in**0.5
    return noise


def synthetic_model(role: Role, seed: int = SEED) -> "torch.nn.Module":
    """diffusers' model of the synthetic `role` VAE with its weights set (the reference of the tests)."""
    import torch

    from h3core.decode.load import build_model

    model = build_model(role, CONFIGS[role])
    file_dtype = getattr(torch, FILE_DTYPES[role])
    values = {}
    for name, tensor in model.state_dict().items():
        if audio_vae.BUFFERS.search(name):
            continue  # the class computes them (filters, zero key bias)
        values[name] = _value(name, tuple(tensor.shape), seed).to(file_dtype).float()
    model.load_state_dict(values, strict=False, assign=True)
    return model.eval().requires_grad_(False)


def synthetic_state_dict(role: Role, seed: int = SEED) -> dict[str, "torch.Tensor"]:
    """The synthetic `role` VAE's tensors in diffusers' layout (weight-norm pairs for the audio VAE)."""
    return {k: v.clone() for k, v in synthetic_model(role, seed).state_dict().items()}


def comfy_tensors(role: Role, diffusers_tensors: dict[str, "torch.Tensor"], config: dict[str, object]) -> dict[str, "torch.Tensor"]:
    """A diffusers-layout VAE state dict -> the Comfy file's tensors (original names / folded weight
    norm, the latent statistics as tensors, the file's dtype)."""
    import torch

    if role == "video":
        tensors = video_vae.diffusers_to_original(diffusers_tensors, int(config["decoder_num_attention_heads"]))
        dim = tensors["decoder.x_embedder.weight"].shape[0]
        tensors["decoder.mask_token"] = torch.zeros(1, 1, dim)
    else:
        tensors = audio_vae.fold_tensors(diffusers_tensors)
    dtype = getattr(torch, FILE_DTYPES[role])
    out = {name: (t.to(dtype) if t.is_floating_point() else t).contiguous() for name, t in tensors.items()}
    out["latents_mean"] = torch.tensor(config["latents_mean"], dtype=torch.float32)
    out["latents_std"] = torch.tensor(config["latents_std"], dtype=torch.float32)
    return out


def write_comfy_file(path: Path, role: Role, diffusers_tensors: dict[str, "torch.Tensor"], config: dict[str, object], metadata: dict[str, str]) -> Path:
    """Write a VAE in the Comfy layout (also what tests use to make Comfy files of random VAEs)."""
    from h3core.files.safetensors import write_safetensors

    return write_safetensors(path, comfy_tensors(role, diffusers_tensors, config), metadata)


def cache_key(role: Role, seed: int = SEED) -> str:
    text = json.dumps(CONFIGS[role], sort_keys=True, default=list) + f"|{seed}|{GENERATOR_VERSION}|{FILE_DTYPES[role]}"
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def synthetic_vae_file(role: Role, seed: int = SEED, directory: Path | None = None) -> tuple[Path, bool]:
    """The cached synthetic `role` VAE file, written first if needed: (path, built).

    A cached file that does not open as that VAE (truncated, another version) is rebuilt; a cache
    folder that cannot take it is one line naming H3_CACHE_DIR."""
    folder = directory or settings.cache_dir()
    path = folder / f"synthetic-{COMFY_NAMES[role]}-{cache_key(role, seed)}.safetensors"
    if path.is_file() and _is_cached(path, role, seed):
        return path, False
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if free_bytes(folder) < 64 << 20:
            raise OSError(errno.ENOSPC, "not enough free space")
        metadata = {"weights": "synthetic", "role": role, "seed": str(seed), "generator": GENERATOR_VERSION, "layout": "comfy"}
        write_comfy_file(path, role, synthetic_state_dict(role, seed), CONFIGS[role], metadata)
    except OSError as err:
        raise CheckpointError(
            f"cannot write the synthetic {role} VAE to the cache folder {folder}: {os_error_reason(err)}; "
            "set H3_CACHE_DIR to a writable folder with room for it"
        ) from None
    return path, True


def _is_cached(path: Path, role: Role, seed: int) -> bool:
    from h3core.files.safetensors import SafetensorsReader

    try:
        with SafetensorsReader([path]) as reader:
            meta = reader.metadata
    except CheckpointError:
        return False
    return meta.get("weights") == "synthetic" and meta.get("role") == role and meta.get("seed") == str(seed) and meta.get("generator") == GENERATOR_VERSION
