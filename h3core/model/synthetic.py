"""The synthetic H3 checkpoint: deterministic weights in the seed's file layout, cached on disk.

With no `--model`, h3 runs this checkpoint through the same loader as a real one (every report says
`weights: synthetic`). It is laid out exactly as the seed's `minimax_h3_fl2va_pruned_nvfp4.safetensors`
(../shared/MINIMAX_H3.md §5.2), at the preset's widths: original key names without a prefix, the
AdaLN-pruned variant (`adaln_t_table` [1025, 8] float32, rank-8 `adaln_proj` in bf16), every block's
qkv_proj / out_proj / fc1 / fc2 in Comfy NVFP4 (high-nibble-first codes, 128x4-swizzled fp8 scales,
`weight_scale_2`, a `comfy_quant` marker `{"format": "nvfp4"}`, no input scale), everything else
bf16 except the float32 islands (patch projections, output heads, the table, `rope.inv_freq`).

Deterministic from (config, seed): every tensor is drawn from its own generator seeded by (seed,
tensor name), so the file does not depend on write order. Cached under `H3_CACHE_DIR`; a cached
file is reused only when its data hash (recorded in its metadata when written) still matches, so a
damaged or edited cache is rebuilt, never run as "synthetic".
"""

from __future__ import annotations

import errno
import hashlib
import math
import zlib
from pathlib import Path
from typing import Iterator

import torch

from h3core import settings
from h3core.errors import CheckpointError
from h3core.files.paths import free_bytes, os_error_reason
from h3core.files.safetensors import read_header, write_safetensors
from h3core.model.checkpoint import SYNTHETIC, WEIGHTS_KEY, TensorSpec, linear_slots
from h3core.model.config import ModelConfig
from h3core.model.dit import H3Model, rope_inv_freq
from h3core.nvfp4 import comfy, layout
from h3core.nvfp4.codec import quantize
from h3core.reports.units import format_bytes

GENERATOR_VERSION = "3"
"""Bump when the synthetic weights change, to invalidate caches (3: MiniMax-H3's real layout)."""

DATA_HASH_KEY = "h3_data_sha256"
CONFIG_KEY = "h3_config"
_NVFP4_MARKER = comfy.ComfyQuant(comfy.NVFP4)


def _generator(seed: int, name: str) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))


NVFP4_BLOCK_LINEARS = ("attn.qkv_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2")
"""The linears of every block the seed's file stores in NVFP4 (the rest is bf16 or float32)."""


def quantized_prefixes(config: ModelConfig) -> set[str]:
    """The linears the seed's file stores in NVFP4: every block's four (`NVFP4_BLOCK_LINEARS`)."""
    return {f"blocks.{i}.{name}" for i in range(config.num_blocks) for name in NVFP4_BLOCK_LINEARS}


def _plan(config: ModelConfig) -> Iterator[tuple[str, tuple[int, ...], str]]:
    """(name, shape, dtype) of every tensor in the file, before markers: the layout the writer fills."""
    model = H3Model(config)
    quantized = quantized_prefixes(config)
    slots = dict(linear_slots(model))
    for prefix, slot in slots.items():
        out, inp = slot.out_features, slot.in_features
        if prefix in quantized:
            rows, cols = comfy.padded_shape(out, inp)
            yield f"{prefix}.weight", (rows, cols // 2), "U8"
            yield f"{prefix}.weight_scale", comfy.scale_shape(out, inp), "F8_E4M3"
            yield f"{prefix}.weight_scale_2", (), "F32"
        else:
            dtype = "F32" if model.fp32_module(prefix) and ".adaln_proj." not in f".{prefix}" else "BF16"
            yield f"{prefix}.weight", (out, inp), dtype
            if slot.bias is not None:
                yield f"{prefix}.bias", (out,), dtype
    for name, buf in model.named_buffers():
        if name.rsplit(".", 1)[0] not in slots:
            yield name, tuple(buf.shape), "F32" if model.fp32_module(name) else "BF16"
    yield "rope.inv_freq", (config.rope_freq_dim,), "F32"


_ITEM = {"U8": 1, "F8_E4M3": 1, "BF16": 2, "F32": 4}


def synthetic_specs(config: ModelConfig) -> list[TensorSpec]:
    """Every tensor of the synthetic (= the seed's) layout for `config`, with its bytes, without making one."""
    specs = [TensorSpec(name, shape, dtype, math.prod(shape) * _ITEM[dtype]) for name, shape, dtype in _plan(config)]
    marker = len(comfy.marker_tensor(_NVFP4_MARKER))
    specs += [TensorSpec(f"{prefix}.{comfy.MARKER}", (marker,), "U8", marker) for prefix in sorted(quantized_prefixes(config))]
    return specs


def synthetic_tensors(config: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """All tensors of a synthetic checkpoint (module docstring)."""
    quantized = quantized_prefixes(config)
    tensors: dict[str, torch.Tensor] = {}
    dtypes = {"BF16": torch.bfloat16, "F32": torch.float32}
    for name, shape, dtype in _plan(config):
        prefix = name.rsplit(".", 1)[0]
        if prefix in quantized:
            if name.endswith(".weight"):
                out, inp = shape[0], layout.unpacked_width(shape[1])
                weight = quantize(torch.randn(out, inp, generator=_generator(seed, name)) / math.sqrt(inp))
                packed, scale = comfy.to_comfy(weight)
                tensors.update({name: packed, f"{prefix}.weight_scale": scale, f"{prefix}.weight_scale_2": weight.global_scale,
                                f"{prefix}.{comfy.MARKER}": comfy.marker_tensor(_NVFP4_MARKER)})
            continue
        tensors[name] = _values(seed, name, shape).to(dtypes[dtype])
    tensors["rope.inv_freq"] = rope_inv_freq(config)
    return tensors


def _values(seed: int, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """Deterministic values that keep activations O(1) and let every block contribute."""
    g = _generator(seed, name)
    if name == "adaln_t_table":  # smooth curves of t: cos(pi k t), as a real table is smooth in t
        t = torch.linspace(0.0, 1.0, shape[0])[:, None]
        return torch.cos(math.pi * torch.arange(shape[1])[None] * t) + 0.05 * torch.randn(shape, generator=g)
    if name.endswith("norm.weight") or name.endswith(("norm1.weight", "norm2.weight", "q_norm.weight", "k_norm.weight")):
        return 1.0 + 0.1 * torch.randn(shape, generator=g)
    if ".adaln_proj.linear." in f".{name}":  # shift, scale, gate around 0.1: every block contributes
        return 0.1 * torch.randn(shape, generator=g) / (math.sqrt(shape[1]) if len(shape) == 2 else 1.0)
    if name.endswith(".bias"):
        return 0.02 * torch.randn(shape, generator=g)
    return torch.randn(shape, generator=g) / math.sqrt(shape[-1])


def metadata(config: ModelConfig, seed: int, data_sha256: str) -> dict[str, str]:
    return {"format": "pt", WEIGHTS_KEY: SYNTHETIC, CONFIG_KEY: config.model_dump_json(), "h3_seed": str(seed),
            "h3_generator": GENERATOR_VERSION, DATA_HASH_KEY: data_sha256}


def synthetic_checkpoint(config: ModelConfig, seed: int = 0, directory: Path | None = None) -> tuple[Path, bool]:
    """Path of the cached synthetic checkpoint for (config, seed), writing it first if needed.

    Returns (path, built): `built` is False when the cached file was reused. A cached file that does
    not read back as that checkpoint (truncated, edited, another config) is derived data: it is
    rebuilt. A cache folder that cannot take the file is one line naming H3_CACHE_DIR.
    """
    key = hashlib.sha256(f"{config.model_dump_json()}|{seed}|{GENERATOR_VERSION}".encode()).hexdigest()[:12]
    folder = directory or settings.cache_dir()
    path = folder / f"synthetic-{config.name}-{key}.safetensors"
    if path.exists() and is_intact_synthetic(path, config):
        return path, False
    expected = sum(spec.nbytes for spec in synthetic_specs(config))
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if free_bytes(folder) < expected:
            raise OSError(errno.ENOSPC, "not enough free space")
        tensors = synthetic_tensors(config, seed)
        write_safetensors(path, tensors, metadata(config, seed, _tensors_sha256(tensors)))
    except OSError as err:
        raise CheckpointError(
            f"cannot write the synthetic checkpoint ({format_bytes(expected)}) to the cache folder {folder}: "
            f"{os_error_reason(err)}; set H3_CACHE_DIR to a writable folder with room for it"
        ) from None
    return path, True


def _tensors_sha256(tensors: dict[str, torch.Tensor]) -> str:
    """A hash of the tensors' bytes in name order (what `is_intact_synthetic` recomputes from the file)."""
    digest = hashlib.sha256()
    for name in sorted(tensors):
        digest.update(tensors[name].contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def is_intact_synthetic(path: Path, config: ModelConfig) -> bool:
    """The file is `config`'s synthetic checkpoint and its data still hashes to what was written."""
    try:
        header, start, meta = read_header(path)
    except CheckpointError:
        return False
    if meta.get(WEIGHTS_KEY) != SYNTHETIC or meta.get(CONFIG_KEY) != config.model_dump_json() or DATA_HASH_KEY not in meta:
        return False
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for name in sorted(header):
            begin, end = header[name]["data_offsets"]
            f.seek(start + begin)
            digest.update(f.read(end - begin))
    return digest.hexdigest() == meta[DATA_HASH_KEY]

