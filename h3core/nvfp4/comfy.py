"""The Comfy / comfy-kitchen on-disk layout of NVFP4 linears, converted to h3's (ModelOpt) layout at load.

Per linear `<prefix>` a Comfy file holds (../shared/MINIMAX_H3.md §5.1, comfy-kitchen
`tensor/nvfp4.py`, ComfyUI `quant_ops.py`):

| tensor | dtype | shape | h3's layout |
|---|---|---|---|
| `.weight` | U8 | `[R_p, C_p/2]`: codes, column `2i` in the HIGH nibble | low nibble first (`swap_nibbles`) |
| `.weight_scale` | F8_E4M3 | `[roundup(R_p, 128), roundup(C_p/16, 4)]`: 128x4-tile swizzled, zero-padded | row-major `[R, C/16]` |
| `.weight_scale_2` | F32 | `[]` | the same |
| `.comfy_quant` | U8 | JSON bytes, e.g. `{"format": "nvfp4"}` | `ComfyQuant` |

`R_p, C_p` are the logical shape rounded up to 16; the logical shape comes from the model, never
from the file. The swizzle is `h3core.nvfp4.swizzle`'s (cuBLAS' "1D block scaling factors"
layout): each 128-row x 4-column tile of scales is 512 contiguous bytes, tiles row-tile major, so
a reader can take the scales of a row range (whole row tiles) or a column range (whole column
tiles of every row tile) without the rest of the tensor (`scale_row_tiles`, `scale_column_tiles`).

Legacy files keep the markers in the safetensors metadata instead (`_quantization_metadata`:
`{"layers": {prefix: {"format": ...}}}`); `legacy_markers` reads those, `read_marker` a tensor.

Also here, for a reader that takes whole linears from a `SafetensorsReader` (the text encoder):
`read_nvfp4_linear` (headers checked, converted, `full_precision_matrix_mult` honoured), the writer
`nvfp4_tensors` (synthetic Comfy files), and Comfy's `int8_tensorwise` tensors (`weight` int8,
`weight_scale` float32 per row `[rows, 1]` or one for all: `W = int8 * scale` in float32, as
comfy-kitchen's eager backend decodes; ConvRot-rotated ones are refused).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Mapping

import torch

from h3core.errors import CheckpointError
from h3core.files.safetensors import FLOAT_DTYPE_NAMES, SafetensorsReader
from h3core.files.text import parse_json
from h3core.nvfp4 import layout
from h3core.nvfp4.codec import NVFP4Weight
from h3core.nvfp4.io import check_values
from h3core.nvfp4.kernels import DeviceKernels
from h3core.nvfp4.linear import NVFP4Linear
from h3core.nvfp4.swizzle import TILE_COLUMNS, TILE_ROWS, swizzle_block_scales, unswizzle_block_scales
from h3core.span import Span

MARKER = "comfy_quant"
"""The per-linear marker tensor: `<prefix>.comfy_quant`."""

LEGACY_METADATA = "_quantization_metadata"

MAX_MARKER_BYTES = 64 << 10
"""The largest `comfy_quant` marker read: ComfyUI's are some 30-60 bytes of JSON."""

NVFP4 = "nvfp4"
INT8_TENSORWISE = "int8_tensorwise"
KNOWN_FORMATS = ("nvfp4", "float8_e4m3fn", "float8_e5m2", "mxfp8", "int8_tensorwise", "convrot_w4a4")
"""Formats ComfyUI's `QUANT_ALGOS` defines; h3 computes with `nvfp4` and names the others in its refusal."""

TILE_BYTES = TILE_ROWS * TILE_COLUMNS
"""One 128 x 4 tile of fp8 scales: 512 bytes."""


@dataclass(frozen=True)
class ComfyQuant:
    """A `comfy_quant` marker: the format, and whether the matmul runs at full precision (dequantize, bf16 GEMM)."""

    format: str
    full_precision_matrix_mult: bool = False
    convrot: bool = False
    """int8_tensorwise only: rows Hadamard-rotated in groups (ConvRot); h3 does not undo it."""


def read_marker(reader: SafetensorsReader, name: str, where: str) -> ComfyQuant:
    """The marker tensor `name` of `reader`: checked to be U8 bytes of at most `MAX_MARKER_BYTES`
    before it is read, then parsed (`where` names the file in messages)."""
    dtype, shape = reader.dtype_name(name), reader.shape(name)
    if dtype != "U8" or len(shape) != 1:
        raise CheckpointError(f"{where}: {name} is {dtype} {list(shape)}, a marker is U8 bytes; the file is corrupt")
    if shape[0] > MAX_MARKER_BYTES:
        raise CheckpointError(f"{where}: {name} holds {shape[0]:,} bytes, a marker at most {MAX_MARKER_BYTES:,}; the file is corrupt")
    return parse_marker(reader.get(name).numpy().tobytes(), f"{where}: {name}")


def parse_marker(raw: bytes, where: str) -> ComfyQuant:
    """A marker's JSON (`where` names the tensor in messages): a format string, an optional bool."""
    data = parse_json(raw, f"{where} is not a JSON quantization marker", "the file is corrupt", error=CheckpointError, limit=MAX_MARKER_BYTES)
    return _marker(data, where)


def _marker(data: object, where: str) -> ComfyQuant:
    if not isinstance(data, dict) or not isinstance(data.get("format"), str):
        raise CheckpointError(f"{where} has no quantization format ({str(data)[:80]}); the file is corrupt")
    flags = {name: data.get(name, False) for name in ("full_precision_matrix_mult", "convrot")}
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise CheckpointError(f"{where}: {name} is {value!r}, not true/false; the file is corrupt")
    return ComfyQuant(data["format"], **flags)


def legacy_markers(metadata: Mapping[str, str], source: str) -> dict[str, ComfyQuant]:
    """The markers an older file keeps in its header's `_quantization_metadata` table, by linear
    (a `<prefix>.comfy_quant` tensor, `read_marker`, wins over its entry here)."""
    markers: dict[str, ComfyQuant] = {}
    legacy = metadata.get(LEGACY_METADATA)
    if legacy is not None:
        table = parse_json(legacy, f"{source}: its {LEGACY_METADATA} metadata", "the file is corrupt", error=CheckpointError, want=dict)
        layers = table.get("layers")
        if not isinstance(layers, dict):
            raise CheckpointError(f"{source}: its {LEGACY_METADATA} metadata is not {{\"layers\": {{...}}}}; the file is corrupt")
        for prefix, conf in layers.items():
            markers[prefix] = _marker(conf, f"{source}: {LEGACY_METADATA}[{prefix!r}]")
    return markers


def marker_tensor(marker: ComfyQuant) -> torch.Tensor:
    """The U8 tensor a Comfy file stores a marker as."""
    data = {"format": marker.format} | ({"full_precision_matrix_mult": True} if marker.full_precision_matrix_mult else {})
    return torch.tensor(list(json.dumps(data).encode()), dtype=torch.uint8)


# --- codes ---------------------------------------------------------------------------------------------


def swap_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """High-nibble-first bytes <-> low-nibble-first bytes (its own inverse)."""
    return (packed >> 4) | (packed << 4)


def swap_nibbles_(packed: torch.Tensor) -> torch.Tensor:
    """`swap_nibbles` in place, for a buffer the caller owns (a loader's fresh read): one temporary
    instead of three, which a 2 GB checkpoint's codes feel (0.79 s -> 0.47 s for 173 MB on the CPU)."""
    high = packed >> 4
    return packed.bitwise_left_shift_(4).bitwise_or_(high)


def padded_shape(out_features: int, in_features: int) -> tuple[int, int]:
    """`(R_p, C_p)`: the logical shape rounded up to multiples of 16."""
    return _ceil_to(out_features, layout.BLOCK_ELEMENTS), _ceil_to(in_features, layout.BLOCK_ELEMENTS)


def scale_shape(out_features: int, in_features: int) -> tuple[int, int]:
    """Shape of a Comfy `weight_scale`: `[roundup(R_p, 128), roundup(C_p / 16, 4)]`."""
    rows, cols = padded_shape(out_features, in_features)
    return _ceil_to(rows, TILE_ROWS), _ceil_to(cols // layout.BLOCK_ELEMENTS, TILE_COLUMNS)


def to_comfy(w: NVFP4Weight) -> tuple[torch.Tensor, torch.Tensor]:
    """`(weight, weight_scale)` as a Comfy file stores them (codes high nibble first, padded rows;
    scales swizzled and zero-padded to whole tiles)."""
    rows, cols = padded_shape(w.out_features, w.in_features)
    packed = w.packed.new_zeros(rows, cols // layout.ELEMENTS_PER_BYTE)
    packed[: w.out_features, : w.packed.shape[1]] = swap_nibbles(w.packed)
    scale = torch.zeros(rows, cols // layout.BLOCK_ELEMENTS, dtype=torch.uint8, device=w.scale.device)
    scale[: w.out_features, : w.scale.shape[1]] = w.scale.view(torch.uint8)
    swizzled = swizzle_block_scales(scale.view(torch.float8_e4m3fn))
    return packed, swizzled.view(scale_shape(w.out_features, w.in_features))


def from_comfy(packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor, out_features: int, in_features: int) -> NVFP4Weight:
    """A whole Comfy linear as h3's `NVFP4Weight` of logical shape `out_features x in_features`."""
    check_comfy_shapes(tuple(packed.shape), tuple(scale.shape), out_features, in_features, "weight")
    rows_128, cols_4 = scale.shape
    table = unswizzle_block_scales(scale.reshape(-1), rows_128, cols_4)  # [rows_128, cols_4]
    return NVFP4Weight(
        swap_nibbles(packed[:out_features, : layout.packed_bytes(in_features)]).contiguous(),
        table[:out_features, : layout.scale_columns(in_features)].contiguous(),
        global_scale,
    )


def check_comfy_shapes(packed: tuple[int, ...], scale: tuple[int, ...], out_features: int, in_features: int, where: str) -> None:
    """The stored shapes a Comfy linear of logical shape `out x in` must have."""
    rows, cols = padded_shape(out_features, in_features)
    if packed != (rows, cols // layout.ELEMENTS_PER_BYTE) or scale != scale_shape(out_features, in_features):
        raise CheckpointError(
            f"{where}: a Comfy NVFP4 linear of {out_features} x {in_features} stores weight {[rows, cols // 2]} and weight_scale "
            f"{list(scale_shape(out_features, in_features))}, the file has {list(packed)} and {list(scale)}; it does not match the model"
        )


# --- scales of a row or column range, reading whole tiles only -----------------------------------------


def scale_row_tiles(rows: Span, scale_columns_4: int) -> Span:
    """The bytes of a swizzled scale tensor holding logical rows `rows`: whole 128-row tiles."""
    first, last = rows.start // TILE_ROWS, -(-rows.stop // TILE_ROWS)
    tile_row_bytes = TILE_ROWS * scale_columns_4
    return Span(first * tile_row_bytes, last * tile_row_bytes)


def rows_from_tiles(raw: torch.Tensor, rows: Span, scale_columns_4: int, scale_columns: int) -> torch.Tensor:
    """Logical rows `rows` (first `scale_columns` columns) from the tiles `scale_row_tiles` read: fp8 `[len, scale_columns]`."""
    first = rows.start // TILE_ROWS
    tiles = raw.numel() // (TILE_ROWS * scale_columns_4)
    table = unswizzle_block_scales(raw.view(torch.float8_e4m3fn), tiles * TILE_ROWS, scale_columns_4)
    return table[rows.start - first * TILE_ROWS : rows.stop - first * TILE_ROWS, :scale_columns].contiguous()


def scale_column_tiles(columns: Span, scale_rows_128: int, scale_columns_4: int) -> list[Span]:
    """The bytes of a swizzled scale tensor holding scale columns `columns` of every row: per row tile,
    one run of whole 4-column tiles."""
    first, last = columns.start // TILE_COLUMNS, -(-columns.stop // TILE_COLUMNS)
    tile_row_bytes = TILE_ROWS * scale_columns_4
    return [
        Span(tile * tile_row_bytes + first * TILE_BYTES, tile * tile_row_bytes + last * TILE_BYTES)
        for tile in range(scale_rows_128 // TILE_ROWS)
    ]


def columns_from_tiles(raw: torch.Tensor, columns: Span, scale_rows_128: int, out_features: int) -> torch.Tensor:
    """Scale columns `columns` of the first `out_features` rows from the runs `scale_column_tiles` read."""
    first, last = columns.start // TILE_COLUMNS, -(-columns.stop // TILE_COLUMNS)
    width = (last - first) * TILE_COLUMNS
    table = unswizzle_block_scales(raw.view(torch.float8_e4m3fn), scale_rows_128, width)  # [rows_128, width]
    return table[:out_features, columns.start - first * TILE_COLUMNS : columns.stop - first * TILE_COLUMNS].contiguous()


# --- whole linears from a reader, and writing them ----------------------------------------------------


def check_nvfp4_headers(reader: SafetensorsReader, prefix: str, out_features: int, in_features: int) -> None:
    """Every tensor of Comfy NVFP4 linear `prefix` has the dtype and shape `out x in` implies (headers only)."""
    rows, cols = padded_shape(out_features, in_features)
    _expect(reader, f"{prefix}.weight", ("U8",), (rows, cols // layout.ELEMENTS_PER_BYTE))
    _expect(reader, f"{prefix}.weight_scale", ("F8_E4M3",), scale_shape(out_features, in_features))
    _expect(reader, f"{prefix}.weight_scale_2", ("F32",), ())
    for name, shape in (("bias", (out_features,)), ("pre_quant_scale", (in_features,))):
        if f"{prefix}.{name}" in reader:
            _expect(reader, f"{prefix}.{name}", FLOAT_DTYPE_NAMES, shape)
    if f"{prefix}.input_scale" in reader:
        _expect(reader, f"{prefix}.input_scale", ("F32",), ())


def read_nvfp4_linear(
    reader: SafetensorsReader, prefix: str, out_features: int, in_features: int, marker: ComfyQuant,
    device: torch.device | str = "cpu",
    kernels: DeviceKernels | None = None,
) -> NVFP4Linear:
    """The whole Comfy NVFP4 linear `prefix` (`out_features x in_features`: the module's shape) as an
    `NVFP4Linear` on `device`. With `full_precision_matrix_mult` it never takes an fp4 GEMM, nor
    the CPU's emulated one: it dequantizes and multiplies in the compute dtype (bf16 on CUDA)."""
    check_nvfp4_headers(reader, prefix, out_features, in_features)
    get = reader.get
    weight = from_comfy(get(f"{prefix}.weight"), get(f"{prefix}.weight_scale"), get(f"{prefix}.weight_scale_2").float().reshape(()),
                        out_features, in_features)
    check_values(reader, prefix, weight.scale, weight.global_scale)
    optional = {name: get(f"{prefix}.{name}") if f"{prefix}.{name}" in reader else None for name in ("bias", "pre_quant_scale", "input_scale")}
    linear = NVFP4Linear(weight, **optional)
    if marker.full_precision_matrix_mult:
        linear.fp4_matmul, linear.emulate_fp4 = False, False
    linear = linear.to(device)
    linear.kernels = kernels
    linear.prepare()
    return linear


def nvfp4_tensors(prefix: str, linear: NVFP4Linear, marker: ComfyQuant) -> dict[str, torch.Tensor]:
    """`{<prefix>.<name>: CPU tensor}` of `linear` in the Comfy layout, its marker included."""
    packed, scale = to_comfy(linear.nvfp4)
    tensors = {"weight": packed, "weight_scale": scale, "weight_scale_2": linear.weight_scale_2, MARKER: marker_tensor(marker)}
    for name in ("pre_quant_scale", "input_scale", "bias"):
        if getattr(linear, name) is not None:
            tensors[name] = getattr(linear, name)
    return {f"{prefix}.{name}": t.detach().to("cpu").contiguous() for name, t in tensors.items()}


# --- int8_tensorwise ---------------------------------------------------------------------------------


def check_int8_headers(reader: SafetensorsReader, prefix: str, rows: int, cols: int, marker: ComfyQuant) -> None:
    """`prefix.weight` int8 `[rows, cols]` with a float32 `prefix.weight_scale` per row or for all."""
    if marker.convrot:
        raise CheckpointError(f"{prefix} is int8_tensorwise with ConvRot (Hadamard-rotated rows), which h3 does not undo; use the NVFP4 export")
    _expect(reader, f"{prefix}.weight", ("I8",), (rows, cols))
    _expect(reader, f"{prefix}.weight_scale", ("F32",), None)
    if reader.shape(f"{prefix}.weight_scale") not in ((rows, 1), (rows,), (), (1,)):
        shape = list(reader.shape(f"{prefix}.weight_scale"))
        raise CheckpointError(f"{prefix}.weight_scale has shape {shape}; int8_tensorwise needs one scale per row ([{rows}, 1]) or one in all")


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`q * scale` in float32, then `dtype`.  q: [r, c]; scale: [r, 1], [r] or one value."""
    per_row = scale.float().reshape(-1, 1) if scale.numel() > 1 else scale.float().reshape(())
    return (q.float() * per_row).to(dtype)


def quantize_int8_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`(int8 [r, c], float32 scale [r, 1])`: each row's amax maps to 127, round to nearest."""
    scale = (weight.float().abs().amax(dim=-1, keepdim=True) / 127.0).clamp(min=1e-30)  # [r, 1]
    return torch.round(weight.float() / scale).clamp(-128, 127).to(torch.int8), scale


def _expect(reader: SafetensorsReader, name: str, dtypes: tuple[str, ...], shape: tuple[int, ...] | None) -> None:
    if name not in reader:
        raise CheckpointError(f"{reader.paths[0]} lacks tensor {name}, which a Comfy quantized module needs")
    dtype, actual = reader.dtype_name(name), reader.shape(name)
    scalar_ok = shape == () and actual == (1,)
    if dtype not in dtypes or (shape is not None and actual != shape and not scalar_ok):
        wanted = "/".join(dtypes) + ("" if shape is None else f" {list(shape)}")
        raise CheckpointError(f"{name} in {reader.file_of(name)} is {dtype} {list(actual)}, expected {wanted} (Comfy layout)")


def _ceil_to(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple
