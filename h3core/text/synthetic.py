"""The synthetic text encoder: a small seeded Qwen3-VL text path written in the Comfy layout of H3's
NVFP4-AWQ file, cached on disk, and read through the same reader as the real one.

What it holds, like `qwen3vl_32b_minimax_h3_nvfp4_awq.safetensors` at small widths: keys
`model.embed_tokens.*` and `model.layers.L.*` (no final norm: a decoder cut after its last layer),
a Comfy `int8_tensorwise` embedding with per-row scales and one row for every id of Qwen3-VL's
151,936-row table (so every id of H3's tokenizer has one), NVFP4 linears with `comfy_quant`
markers `{"format": "nvfp4", "full_precision_matrix_mult": true}`, high-nibble-first codes and
swizzled scales, AWQ `pre_quant_scale` on `o_proj` and `down_proj` only, bf16 norms, and its config
in the header (a Qwen3-VL config: M-RoPE sections 4, 2, 2 for its 16-wide heads). Its width is the
denoiser's text width; the rest is small (3 layers, 4 query and 2 key/value heads of 16, SwiGLU
width 64), so it builds in well under a second at width 64 (10 MB) and in seconds at 5120 (the
embedding: 0.78 GB on disk, of which a prompt reads its own rows).

And a vision tower in the Comfy layout (`visual.*`, all bf16, the real key names and H3's patch
geometry: 16 px patches of 2 frames, 2x2 merge, a 48 x 48 position table) at small widths: 4
blocks of width 64 (4 heads), MLP 128, deepstack mergers after blocks 1, 2 and 3, merged rows of
the text width. It is read only when a request has keyframes, so keyframes work with no weights.
Its hidden states carry no meaning; every report says `synthetic`.
"""

from __future__ import annotations

import errno
import hashlib
import math
from pathlib import Path

import torch

from h3core import settings
from h3core.errors import CheckpointError, ConfigError
from h3core.files.paths import free_bytes, os_error_reason
from h3core.files.safetensors import SafetensorsReader, write_safetensors
from h3core.nvfp4 import comfy, layout
from h3core.nvfp4.codec import quantize
from h3core.nvfp4.linear import NVFP4Linear
from h3core.reports.units import format_bytes
from h3core.text.checkpoint import (
    METADATA_CONFIG,
    VISION_PREFIXES,
    PLAIN_PREFIX,
    SYNTHETIC_FORMAT,
    config_metadata,
    expected_linear_shapes,
    expected_vector_shapes,
)
from h3core.text.config import QWEN3_RMS_NORM_EPS, QWEN3_VL_ROPE_THETA, Qwen3TextConfig, Qwen3VisionConfig
from h3core.text.vision_checkpoint import expected_vision_shapes

SYNTHETIC_VERSION = "2"
"""Bump when the synthetic weights change, to invalidate cached files."""

SYNTHETIC_VOCAB = 151_936
"""Qwen3-VL-32B's embedding rows (`vocab_size`), beyond the 151,676 ids of H3's tokenizer."""

AWQ_LINEARS = ("self_attn.o_proj", "mlp.down_proj")
"""The linears with an AWQ `pre_quant_scale` in H3's Comfy file (MINIMAX_H3.md 4.3)."""

LINEAR_MARKER = comfy.ComfyQuant(format=comfy.NVFP4, full_precision_matrix_mult=True)
EMBEDDING_MARKER = comfy.ComfyQuant(format=comfy.INT8_TENSORWISE)

_INT8_STD = math.sqrt((256**2 - 1) / 12)
"""Standard deviation of integers drawn uniformly from -128..127: a row scale of 1/this gives unit rows."""


def synthetic_config(hidden_size: int) -> Qwen3TextConfig:
    """The synthetic decoder's dimensions for a denoiser text width of `hidden_size`."""
    if hidden_size <= 0 or not layout.is_block_aligned(hidden_size):
        raise ConfigError(
            f"text width {hidden_size} is not a positive multiple of {layout.BLOCK_ELEMENTS}; the synthetic "
            "text encoder's NVFP4 linears need whole 16-element blocks"
        )
    return Qwen3TextConfig(
        vocab_size=SYNTHETIC_VOCAB, hidden_size=hidden_size, num_layers=3, num_heads=4, num_kv_heads=2,
        head_dim=16, intermediate_size=64, rope_theta=QWEN3_VL_ROPE_THETA, rms_norm_eps=QWEN3_RMS_NORM_EPS,
        mrope_section=(4, 2, 2),
    )


def synthetic_vision_config(hidden_size: int) -> Qwen3VisionConfig:
    """The synthetic vision tower: H3's patch geometry and position grid at small widths, rows of `hidden_size`."""
    return Qwen3VisionConfig(
        depth=4, hidden_size=64, num_heads=4, intermediate_size=128, patch_size=16, temporal_patch_size=2,
        spatial_merge_size=2, out_hidden_size=hidden_size, num_position_embeddings=2304, deepstack_visual_indexes=(1, 2, 3),
    )


def synthetic_text_encoder(hidden_size: int, seed: int = 0, directory: Path | None = None) -> tuple[Path, bool]:
    """The cached synthetic encoder file for (`hidden_size`, `seed`), written first if needed.

    Returns (path, built). A cached file that does not read back as that encoder (truncated,
    another version) is rebuilt; a cache folder that cannot take it is one line naming H3_CACHE_DIR.
    """
    config = synthetic_config(hidden_size)
    metadata = _metadata(config, seed)
    key = hashlib.sha256("|".join(f"{k}={v}" for k, v in sorted(metadata.items())).encode()).hexdigest()[:12]
    folder = directory or settings.cache_dir()
    path = folder / f"synthetic-text-encoder-{hidden_size}-{key}.safetensors"
    if path.exists() and _is_cached(path, metadata):
        return path, False
    expected = _file_bytes(config)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if free_bytes(folder) < expected:
            raise OSError(errno.ENOSPC, "not enough free space")
        write_safetensors(path, synthetic_tensors(config, seed), metadata)
    except OSError as err:
        raise CheckpointError(
            f"cannot write the synthetic text encoder ({format_bytes(expected)}) to the cache folder {folder}: "
            f"{os_error_reason(err)}; set H3_CACHE_DIR to a writable folder with room for it"
        ) from None
    return path, True


def synthetic_tensors(config: Qwen3TextConfig, seed: int) -> dict[str, torch.Tensor]:
    """Every tensor of the synthetic encoder, in the Comfy layout, drawn from one seeded generator."""
    generator = torch.Generator().manual_seed(seed)
    tensors = _embedding(config, generator)
    for index in range(config.num_layers):
        layer = f"{PLAIN_PREFIX}layers.{index}."
        for name, shape in expected_vector_shapes(config).items():
            tensors[layer + name] = (1.0 + 0.1 * torch.randn(shape, generator=generator)).to(torch.bfloat16)  # norm gains near 1
        for name, (out, inp) in expected_linear_shapes(config).items():
            tensors |= comfy.nvfp4_tensors(layer + name, _linear(out, inp, name in AWQ_LINEARS, generator), LINEAR_MARKER)
    return tensors | _vision(synthetic_vision_config(config.hidden_size), generator)


def _vision(config: Qwen3VisionConfig, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """The tower's tensors (`visual.*`, bf16): norm gains near 1, small biases, a position table of
    order 1, variance-preserving weights."""
    tensors = {}
    for name, shape in expected_vision_shapes(config).items():
        if ".norm" in name or name.startswith("norm"):
            value = (1.0 if name.endswith("weight") else 0.0) + 0.1 * torch.randn(shape, generator=generator)
        elif name.endswith("bias"):
            value = 0.02 * torch.randn(shape, generator=generator)
        elif name == "pos_embed.weight":
            value = 0.5 * torch.randn(shape, generator=generator)
        else:
            fan_in = math.prod(shape[1:])
            value = torch.randn(shape, generator=generator) / math.sqrt(fan_in)
        tensors[f"{VISION_PREFIXES['synthetic']}{name}"] = value.to(torch.bfloat16)
    return tensors


def _embedding(config: Qwen3TextConfig, generator: torch.Generator) -> dict[str, torch.Tensor]:
    module = f"{PLAIN_PREFIX}embed_tokens"
    # uniform bytes, drawn 8 at a time (a fourth of the time of int8 draws at 0.78 GB): [V, D] int8
    words = torch.empty(config.vocab_size * config.hidden_size // 8, dtype=torch.int64).random_(-(2**63), 2**63 - 1, generator=generator)
    rows = words.view(torch.int8).view(config.vocab_size, config.hidden_size)
    scale = (0.75 + 0.5 * torch.rand(config.vocab_size, 1, generator=generator)) / _INT8_STD  # [V, 1]: rows of std ~1
    return {f"{module}.weight": rows, f"{module}.weight_scale": scale, f"{module}.{comfy.MARKER}": comfy.marker_tensor(EMBEDDING_MARKER)}


def _linear(out: int, inp: int, awq: bool, generator: torch.Generator) -> NVFP4Linear:
    """A variance-preserving `out x in` weight; with `awq`, stored divided by a pre-scale the input is multiplied by."""
    weight = torch.randn(out, inp, generator=generator) / math.sqrt(inp)  # [out, in]
    if not awq:
        return NVFP4Linear(quantize(weight))
    pre_scale = torch.exp(0.25 * torch.randn(inp, generator=generator)).to(torch.bfloat16)  # [in]
    return NVFP4Linear(quantize(weight / pre_scale.float()), pre_quant_scale=pre_scale)


def _metadata(config: Qwen3TextConfig, seed: int) -> dict[str, str]:
    return {
        "format": SYNTHETIC_FORMAT, "weights": "synthetic", "version": SYNTHETIC_VERSION, "seed": str(seed),
        METADATA_CONFIG: config_metadata(config.model_dump(), synthetic_vision_config(config.hidden_size).model_dump()),
    }


def _is_cached(path: Path, metadata: dict[str, str]) -> bool:
    """The file opens as a safetensors file (header and size) and is the encoder `metadata` describes."""
    try:
        with SafetensorsReader([path]) as reader:
            found = reader.metadata
    except CheckpointError:
        return False
    return all(found.get(k) == v for k, v in metadata.items())


def _file_bytes(config: Qwen3TextConfig) -> int:
    """About the size of the file (the embedding and the linears; norms and headers are small)."""
    embedding = config.vocab_size * (config.hidden_size + 4)
    linears = sum(layout.storage_bytes(out, inp) + 2 * inp for out, inp in expected_linear_shapes(config).values())
    vision = sum(2 * math.prod(shape) for shape in expected_vision_shapes(synthetic_vision_config(config.hidden_size)).values())
    return embedding + config.num_layers * linears + vision + (1 << 20)
