"""Quantized tensors as ComfyUI / comfy-kitchen files store them, converted at load to h3's layout.

What a Comfy file holds per quantized module `<m>` (comfy-kitchen 0.2.40 `tensor/nvfp4.py`,
`tensor/int8.py`, `backends/eager/quantization.py`, `float_utils.py`; ../shared/MINIMAX_H3.md §5):

- `<m>.comfy_quant`: uint8 bytes of a JSON object, `{"format": "nvfp4"}` with an optional
  `"full_precision_matrix_mult": true` (dequantize and run the GEMM in the compute dtype). Older
  files carry the same objects in the header instead: `__metadata__["_quantization_metadata"]` =
  `{"layers": {<m>: {...} or "<format>"}}`. `parse_marker` turns either into a `ComfyQuant`.
- nvfp4: `weight` uint8 `[roundup(out, 16), roundup(in, 16) / 2]`, E2M1 codes **high nibble
  first** (column 2j in `b >> 4`); `weight_scale` float8-e4m3 `[roundup(out, 128),
  roundup(in / 16, 4)]`, the block scales in cuBLAS's `to_blocked` 128x4 swizzle, zero padded;
  `weight_scale_2` float32 `[]`, the decode multiplier; optional `pre_quant_scale` `[in]` (AWQ:
  multiplies the input), `input_scale` `[]`, `bias` `[out]`. The logical `out x in` is the
  module's, not the file's: pad rows and columns are dropped.
- int8_tensorwise: `weight` int8 `[rows, cols]` and `weight_scale` float32, one per row
  (`[rows, 1]`) or one for the tensor (`[]`); `W = int8 * scale` in float32. With `"convrot": true`
  the rows are Hadamard-rotated, which h3 does not undo: refused.

h3 keeps NVFP4 in the ModelOpt layout (`NVFP4Weight`: low nibble first, row-major scales), so
`from_comfy` swaps the nibbles, unswizzles the scales and drops the padding, and `to_comfy` is
its inverse (for writing Comfy-layout files, e.g. synthetic ones). Nothing here knows which model
a tensor belongs to.
"""

from __future__ import annotations

import json
from typing import Any, Mapping

import torch
from pydantic import BaseModel, ConfigDict, ValidationError

from h3core.errors import CheckpointError, NVFP4FormatError
from h3core.files.safetensors import FLOAT_DTYPE_NAMES, SafetensorsReader
from h3core.nvfp4 import layout
from h3core.nvfp4.codec import NVFP4Weight
from h3core.nvfp4.linear import NVFP4Linear
from h3core.nvfp4.swizzle import TILE_COLUMNS, TILE_ROWS, swizzle_block_scales, unswizzle_block_scales

MARKER = "comfy_quant"
"""The suffix of a module's marker tensor: `<module>.comfy_quant`."""

METADATA_KEY = "_quantization_metadata"
"""The header metadata key of older files: JSON `{"layers": {module: marker}}`."""

NVFP4 = "nvfp4"
INT8_TENSORWISE = "int8_tensorwise"
READABLE_FORMATS = (NVFP4, INT8_TENSORWISE)
"""The `format`s h3 reads; any other is refused, by name."""

PAD_MULTIPLE = 16
"""comfy-kitchen pads an NVFP4 weight's rows and columns to multiples of 16 (`get_padded_shape`)."""


class ComfyQuant(BaseModel):
    """One module's `comfy_quant` marker."""

    model_config = ConfigDict(frozen=True, extra="allow")

    format: str
    """nvfp4, int8_tensorwise, float8_e4m3fn, mxfp8, ... (h3 reads `READABLE_FORMATS`)."""

    full_precision_matrix_mult: bool = False
    """Dequantize the weight and multiply in the compute dtype, even where an fp4 GEMM exists."""

    convrot: bool = False
    """int8_tensorwise only: the rows are Hadamard-rotated in groups of `convrot_groupsize`."""

    convrot_groupsize: int = 256


def parse_marker(raw: torch.Tensor | bytes | str | Mapping[str, Any], where: str) -> ComfyQuant:
    """The marker `raw` (the U8 tensor, its bytes, its text, or the parsed object) of module
    `where`; a `CheckpointError` line names a malformed marker or a format h3 does not read."""
    try:
        value = _decoded(raw)
        quant = ComfyQuant.model_validate(value)
    except (UnicodeDecodeError, json.JSONDecodeError, ValidationError, TypeError) as err:
        reason = err.errors()[0]["msg"] if isinstance(err, ValidationError) else type(err).__name__
        raise CheckpointError(
            f"{where}.{MARKER} is not a ComfyUI quantization marker ({reason}); the file is corrupt or not a Comfy export"
        ) from None
    if quant.format not in READABLE_FORMATS:
        raise CheckpointError(
            f"{where} is quantized as {quant.format!r} ({where}.{MARKER}), a format h3 does not read; "
            f"h3 reads {' and '.join(READABLE_FORMATS)}: use the NVFP4 export of this model"
        )
    return quant


def _decoded(raw: torch.Tensor | bytes | str | Mapping[str, Any]) -> Mapping[str, Any]:
    if isinstance(raw, torch.Tensor):
        raw = raw.detach().cpu().reshape(-1).to(torch.uint8).numpy().tobytes()
    if isinstance(raw, bytes):
        raw = raw.decode("utf-8")
    if isinstance(raw, str):
        raw = json.loads(raw)
    if not isinstance(raw, Mapping):
        raise TypeError("not a JSON object")
    return raw


def metadata_markers(metadata: Mapping[str, str]) -> dict[str, ComfyQuant]:
    """Markers an older file keeps in its header (`__metadata__["_quantization_metadata"]`), by module."""
    text = metadata.get(METADATA_KEY)
    if text is None:
        return {}
    try:
        layers = json.loads(text)["layers"]
        items = dict(layers).items()
    except (json.JSONDecodeError, KeyError, TypeError, ValueError):
        raise CheckpointError(f"the header's {METADATA_KEY} is not {{\"layers\": {{...}}}}; the file is corrupt") from None
    return {name: parse_marker({"format": conf} if isinstance(conf, str) else conf, name) for name, conf in items}


def marker_tensor(quant: ComfyQuant) -> torch.Tensor:
    """The U8 `comfy_quant` tensor of `quant`, as Comfy writes it (compact JSON)."""
    fields = quant.model_dump(exclude_defaults=True)  # format first: it has no default
    return torch.tensor(list(json.dumps(fields, separators=(",", ":")).encode()), dtype=torch.uint8)


# --- nvfp4 ------------------------------------------------------------------------------------------


def packed_shape(out_features: int, in_features: int) -> tuple[int, int]:
    """Shape of the Comfy `weight` of an `out x in` NVFP4 linear (rows and columns padded to 16)."""
    return _ceil_to(out_features, PAD_MULTIPLE), _ceil_to(in_features, PAD_MULTIPLE) // layout.ELEMENTS_PER_BYTE


def scale_shape(out_features: int, in_features: int) -> tuple[int, int]:
    """Shape of the Comfy `weight_scale`: the padded scale matrix padded again to 128x4 tiles."""
    blocks = _ceil_to(in_features, PAD_MULTIPLE) // layout.BLOCK_ELEMENTS
    return _ceil_to(out_features, TILE_ROWS), _ceil_to(blocks, TILE_COLUMNS)


def swap_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Every byte's two codes exchanged: Comfy's high-first order <-> ModelOpt's low-first."""
    return (packed << 4) | (packed >> 4)


def from_comfy(
    packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor, out_features: int, in_features: int
) -> NVFP4Weight:
    """The `out x in` NVFP4 weight stored as Comfy's `weight`, `weight_scale`, `weight_scale_2`."""
    if in_features % layout.BLOCK_ELEMENTS:
        raise NVFP4FormatError(
            f"an NVFP4 linear with {in_features} inputs pads its last block; h3 holds whole "
            f"{layout.BLOCK_ELEMENTS}-element blocks only"
        )
    if tuple(packed.shape) != packed_shape(out_features, in_features) or scale.numel() != _numel(scale_shape(out_features, in_features)):
        raise NVFP4FormatError(
            f"Comfy NVFP4 tensors {list(packed.shape)} and {list(scale.shape)} do not hold an "
            f"{out_features} x {in_features} weight (expected {list(packed_shape(out_features, in_features))} "
            f"and {list(scale_shape(out_features, in_features))})"
        )
    codes = swap_nibbles(packed[:out_features, : layout.packed_columns(in_features)])  # [out, in/2]
    scales = unswizzle_block_scales(scale.reshape(-1), out_features, layout.scale_columns(in_features))  # [out, in/16]
    return NVFP4Weight(codes.contiguous(), scales, global_scale.to(torch.float32).reshape(()))


def to_comfy(weight: NVFP4Weight) -> tuple[torch.Tensor, torch.Tensor]:
    """`(weight, weight_scale)` as Comfy stores `weight`: hi-first codes with padded rows, swizzled scales."""
    rows, cols = packed_shape(weight.out_features, weight.in_features)
    packed = weight.packed.new_zeros(rows, cols)
    packed[: weight.out_features] = swap_nibbles(weight.packed)
    scale = swizzle_block_scales(weight.scale).view(scale_shape(weight.out_features, weight.in_features))
    return packed, scale


def nvfp4_tensors(prefix: str, linear: NVFP4Linear, quant: ComfyQuant) -> dict[str, torch.Tensor]:
    """`{<prefix>.<name>: CPU tensor}` of `linear` in the Comfy layout, marker included."""
    packed, scale = to_comfy(linear.nvfp4)
    tensors = {"weight": packed, "weight_scale": scale, "weight_scale_2": linear.weight_scale_2, MARKER: marker_tensor(quant)}
    for name in ("pre_quant_scale", "input_scale", "bias"):
        if getattr(linear, name) is not None:
            tensors[name] = getattr(linear, name)
    return {f"{prefix}.{name}": t.detach().to("cpu").contiguous() for name, t in tensors.items()}


def read_nvfp4_linear(
    reader: SafetensorsReader,
    prefix: str,
    out_features: int,
    in_features: int,
    quant: ComfyQuant,
    device: torch.device | str = "cpu",
) -> NVFP4Linear:
    """The Comfy NVFP4 linear `prefix` (`out_features x in_features`, the module's shape), as an
    `NVFP4Linear` on `device`. With `full_precision_matrix_mult` it never takes an fp4 GEMM
    (weight-only: dequantize, multiply in the compute dtype; bf16 on CUDA)."""
    check_nvfp4_headers(reader, prefix, out_features, in_features)
    get = reader.get
    weight = from_comfy(get(f"{prefix}.weight"), get(f"{prefix}.weight_scale"), get(f"{prefix}.weight_scale_2"), out_features, in_features)
    _check_values(prefix, weight)
    optional = {name: get(f"{prefix}.{name}") if f"{prefix}.{name}" in reader else None for name in ("bias", "pre_quant_scale", "input_scale")}
    linear = NVFP4Linear(weight, **optional)
    if quant.full_precision_matrix_mult:
        linear.fp4_matmul, linear.emulate_fp4 = False, False
    linear = linear.to(device)
    linear.prepare()
    return linear


def check_nvfp4_headers(reader: SafetensorsReader, prefix: str, out_features: int, in_features: int) -> None:
    """Every tensor of Comfy NVFP4 linear `prefix` has the dtype and shape `out x in` implies (headers only)."""
    _expect(reader, f"{prefix}.weight", ("U8",), packed_shape(out_features, in_features))
    _expect(reader, f"{prefix}.weight_scale", ("F8_E4M3",), scale_shape(out_features, in_features))
    _expect(reader, f"{prefix}.weight_scale_2", ("F32",), ())
    for name, shape in (("bias", (out_features,)), ("pre_quant_scale", (in_features,))):
        if f"{prefix}.{name}" in reader:
            _expect(reader, f"{prefix}.{name}", FLOAT_DTYPE_NAMES, shape)
    if f"{prefix}.input_scale" in reader:
        _expect(reader, f"{prefix}.input_scale", ("F32",), ())


def _check_values(prefix: str, weight: NVFP4Weight) -> None:
    value = float(weight.global_scale)
    if not 0 < value < float("inf"):
        raise CheckpointError(f"{prefix}.weight_scale_2 is {value}; a global scale must be positive and finite (corrupt file?)")
    if bool(((weight.scale.view(torch.uint8) & 0x7F) == 0x7F).any()):
        raise CheckpointError(f"{prefix}.weight_scale holds NaN block scales; the file is corrupt: download it again")


# --- int8_tensorwise ---------------------------------------------------------------------------------


def check_int8_headers(reader: SafetensorsReader, prefix: str, rows: int, cols: int, quant: ComfyQuant) -> None:
    """`prefix.weight` int8 `[rows, cols]` with a float32 `prefix.weight_scale` per row or per tensor."""
    if quant.convrot:
        raise CheckpointError(
            f"{prefix} is int8_tensorwise with ConvRot (Hadamard-rotated rows), which h3 does not undo; use the NVFP4 export"
        )
    _expect(reader, f"{prefix}.weight", ("I8",), (rows, cols))
    _expect(reader, f"{prefix}.weight_scale", ("F32",), None)
    if reader.shape(f"{prefix}.weight_scale") not in ((rows, 1), (rows,), (), (1,)):
        shape = list(reader.shape(f"{prefix}.weight_scale"))
        raise CheckpointError(f"{prefix}.weight_scale has shape {shape}; int8_tensorwise needs one scale per row ([{rows}, 1]) or one in all")


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`q * scale` in float32 (comfy-kitchen's eager decode), then `dtype`.  q: [r, c]; scale: [r, 1], [r] or []."""
    per_row = scale.float().reshape(-1, 1) if scale.numel() > 1 else scale.float().reshape(())
    return (q.float() * per_row).to(dtype)


def quantize_int8_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`(int8 [r, c], float32 scale [r, 1])`: each row's amax maps to 127, round to nearest."""
    scale = (weight.float().abs().amax(dim=-1, keepdim=True) / 127.0).clamp(min=1e-30)  # [r, 1]
    return torch.round(weight.float() / scale).clamp(-128, 127).to(torch.int8), scale


# --- shared -----------------------------------------------------------------------------------------


def _expect(reader: SafetensorsReader, name: str, dtypes: tuple[str, ...], shape: tuple[int, ...] | None) -> None:
    if name not in reader:
        raise CheckpointError(f"{reader.paths[0]} lacks tensor {name}, which a Comfy quantized module needs")
    dtype, actual = reader.dtype_name(name), reader.shape(name)
    scalar_ok = shape == () and actual == (1,)
    if dtype not in dtypes or (shape is not None and actual != shape and not scalar_ok):
        wanted = "/".join(dtypes) + ("" if shape is None else f" {list(shape)}")
        raise CheckpointError(f"{name} in {reader.file_of(name)} is {dtype} {list(actual)}, expected {wanted} (Comfy layout)")


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for n in shape:
        count *= n
    return count


def _ceil_to(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple
