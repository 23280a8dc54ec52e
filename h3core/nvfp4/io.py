"""NVFP4 linears in safetensors files, with ModelOpt names, and the one `WeightSource` loaders read through.

A linear `<prefix>` is stored as `<prefix>.weight` (uint8 `[out, in/2]`), `.weight_scale` (F8_E4M3
`[out, in/16]`), `.weight_scale_2` (F32 `[]`) and optionally `.bias` (`[out]`), `.pre_quant_scale`
(`[in]`) and `.input_scale` (F32 `[]`). `read_linear` builds an `NVFP4Linear` (whole, column-parallel
rows, or row-parallel block-aligned columns) through a `SafetensorsReader` (`h3core.files`), which
reads only the bytes of the slice asked for, after checking every tensor's dtype and shape against
the others from the headers.

`WeightSource` is how a model is assembled from named weights, whoever holds them:
`CheckpointWeights` (a safetensors checkpoint: the H3 denoiser's tensor-mode shards, the text
encoder's layers), the synthetic text encoder's generator, an in-memory model's shards
(`h3core.parallel.modes.tensor.ModelWeights`).
"""

from __future__ import annotations

from typing import Iterator, Protocol, Sequence

import torch
from torch import nn

from h3core.errors import CheckpointError, NVFP4FormatError
from h3core.files.safetensors import FLOAT_DTYPE_NAMES, SafetensorsReader
from h3core.nvfp4 import layout
from h3core.nvfp4.codec import NVFP4Weight
from h3core.nvfp4.layout import ColumnSlice
from h3core.nvfp4.kernels import DeviceKernels
from h3core.nvfp4.linear import DenseLinear, NVFP4Linear
from h3core.nvfp4.shard import check_columns, check_rows
from h3core.span import Span

WEIGHT, WEIGHT_SCALE, GLOBAL_SCALE = "weight", "weight_scale", "weight_scale_2"
BIAS, PRE_QUANT_SCALE, INPUT_SCALE = "bias", "pre_quant_scale", "input_scale"


def linear_tensors(prefix: str, linear: NVFP4Linear) -> dict[str, torch.Tensor]:
    """`{<prefix>.<ModelOpt name>: CPU tensor}` of `linear`, ready for `safetensors.torch.save_file`."""
    return {f"{prefix}.{name}": t.detach().to("cpu").contiguous() for name, t in linear.state_dict().items()}


def read_linear(
    reader: SafetensorsReader,
    prefix: str,
    rows: Sequence[Span] | None = None,
    columns: ColumnSlice | None = None,
    device: torch.device | str | None = None,
    kernels: DeviceKernels | None = None,
) -> NVFP4Linear:
    """The NVFP4 linear `prefix`, reading only what is asked for, prepared for the path `kernels` (its
    device's facts; None: the device's own) give it.

    `rows`: the column-parallel shard, same as `column_parallel(full, rows)` (bias rows included).
    `columns`: the row-parallel shard, same as `row_parallel(full, columns)[0]`: no bias (read it
    with `reader.get(prefix + ".bias")` and add it once after the reduction).
    """
    if rows is not None and columns is not None:
        raise ValueError("read_linear takes rows (column-parallel) or columns (row-parallel), not both")
    out_features, in_features = check_linear_header(reader, prefix)
    try:
        if rows is not None:
            check_rows(rows, out_features)
        if columns is not None:
            check_columns(columns, in_features)
    except NVFP4FormatError as err:
        raise CheckpointError(f"{prefix}: {err}") from None
    weight = _read_weight(reader, prefix, rows, columns)
    bias = _read_optional(reader, f"{prefix}.{BIAS}", rows, None) if columns is None else None
    pre_scale = _read_optional(reader, f"{prefix}.{PRE_QUANT_SCALE}", None, columns.elements if columns else None)
    input_scale = _read_optional(reader, f"{prefix}.{INPUT_SCALE}", None, None)
    linear = NVFP4Linear(weight, bias, pre_scale, input_scale)
    if device is not None:
        linear = linear.to(device)
    linear.kernels = kernels
    linear.prepare()  # the fp4 GEMM's operands, built here at load and never in the denoising loop
    return linear


def _read_weight(
    reader: SafetensorsReader, prefix: str, rows: Sequence[Span] | None, columns: ColumnSlice | None
) -> NVFP4Weight:
    names = (f"{prefix}.{WEIGHT}", f"{prefix}.{WEIGHT_SCALE}")
    if rows is not None:
        packed, scale = (reader.get_rows(name, rows) for name in names)
    elif columns is not None:
        packed = reader.get_columns(names[0], columns.packed_bytes)
        scale = reader.get_columns(names[1], columns.scale_columns)
    else:
        packed, scale = (reader.get(name) for name in names)
    global_scale = reader.get(f"{prefix}.{GLOBAL_SCALE}").reshape(())
    check_values(reader, prefix, scale, global_scale)
    return NVFP4Weight(packed, scale, global_scale)


def _read_optional(
    reader: SafetensorsReader, name: str, rows: Sequence[Span] | None, cols: Span | None
) -> torch.Tensor | None:
    if name not in reader:
        return None
    if rows is not None:
        return reader.get_rows(name, rows)
    if cols is not None:
        return reader.get_columns(name, cols)
    return reader.get(name)


def check_linear_header(reader: SafetensorsReader, prefix: str) -> tuple[int, int]:
    """(out, in) of linear `prefix`, after checking every tensor's dtype and shape from the headers."""
    weight_name = f"{prefix}.{WEIGHT}"
    shape = reader.shape(weight_name)
    _expect(reader, weight_name, ("U8",), None)
    if len(shape) != 2 or shape[1] % layout.BLOCK_BYTES or shape[1] == 0:
        raise CheckpointError(
            f"{weight_name} in {reader.file_of(weight_name)} has shape {shape}; an NVFP4 weight is "
            f"[out, in/2] with in a multiple of {layout.BLOCK_ELEMENTS}"
        )
    out_features, in_features = shape[0], shape[1] * layout.ELEMENTS_PER_BYTE
    _expect(reader, f"{prefix}.{WEIGHT_SCALE}", ("F8_E4M3",), (out_features, layout.scale_columns(in_features)))
    _expect(reader, f"{prefix}.{GLOBAL_SCALE}", ("F32",), ())
    if f"{prefix}.{INPUT_SCALE}" in reader:
        _expect(reader, f"{prefix}.{INPUT_SCALE}", ("F32",), ())
    if f"{prefix}.{BIAS}" in reader:
        _expect(reader, f"{prefix}.{BIAS}", FLOAT_DTYPE_NAMES, (out_features,))
    if f"{prefix}.{PRE_QUANT_SCALE}" in reader:
        _expect(reader, f"{prefix}.{PRE_QUANT_SCALE}", FLOAT_DTYPE_NAMES, (in_features,))
    return out_features, in_features


def _expect(reader: SafetensorsReader, name: str, dtypes: tuple[str, ...], shape: tuple[int, ...] | None) -> None:
    """Check `name`'s dtype and shape (`()` also accepts `[1]`: some exports store scalars that way)."""
    dtype, actual = reader.dtype_name(name), reader.shape(name)
    shape_ok = shape is None or actual == shape or (shape == () and actual == (1,))
    if dtype not in dtypes or not shape_ok:
        wanted = f"{'/'.join(dtypes)}" + ("" if shape is None else f" {list(shape)}")
        raise CheckpointError(
            f"{name} in {reader.file_of(name)} is {dtype} {list(actual)}, expected {wanted}; "
            f"the file is not a ModelOpt NVFP4 export of this model"
        )


def check_values(reader: SafetensorsReader, prefix: str, scale: torch.Tensor, global_scale: torch.Tensor) -> None:
    value = float(global_scale)
    if not (0 < value < float("inf")):
        raise CheckpointError(
            f"{prefix}.{GLOBAL_SCALE} is {value}; a global scale must be positive and finite (corrupt file?)"
        )
    if bool(((scale.view(torch.uint8) & 0x7F) == 0x7F).any()):
        raise CheckpointError(f"{prefix}.{WEIGHT_SCALE} holds NaN block scales; the file is corrupt: download it again")


def iter_prefixes(reader: SafetensorsReader) -> Iterator[str]:
    """Prefixes of the NVFP4 linears in `reader` (names ending in `.weight_scale_2`)."""
    suffix = f".{GLOBAL_SCALE}"
    return (name[: -len(suffix)] for name in reader.keys() if name.endswith(suffix))


# --- where weights come from --------------------------------------------------------------------------


class WeightSource(Protocol):
    """Hands out a model's tensors and linears by their names in the state dict (or checkpoint)."""

    def has(self, name: str) -> bool:
        """Whether tensor `name` exists (optional tensors: biases, scales)."""
        ...

    def tensor(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A plain tensor on the target device, in `dtype` (None: as stored)."""
        ...

    def linear(self, prefix: str, *, rows: Sequence[Span] | None = None, columns: ColumnSlice | None = None) -> nn.Module:
        """The linear whose tensors are `prefix.*`; with `rows` only those output rows (column-parallel,
        bias rows included), with `columns` only those input columns (row-parallel, no bias: read
        `tensor(prefix + ".bias")` and add it once after the reduction)."""
        ...


class CheckpointWeights:
    """A `WeightSource` over a safetensors reader: NVFP4 linears through `read_linear` (a shard reads
    only its slice), unquantized ones as `DenseLinear` in their stored dtype. `kinds` records which
    kinds of linear were read ('nvfp4', 'dense'). Every NVFP4 linear it reads shares `kernels` (the
    device's facts: given, else the device's own, asked once for all of them)."""

    def __init__(self, reader: SafetensorsReader, device: torch.device | str, kernels: DeviceKernels | None = None):
        self.reader, self.device = reader, torch.device(device)
        self.kernels = kernels or DeviceKernels.of(self.device)
        self.kinds: set[str] = set()

    def has(self, name: str) -> bool:
        return name in self.reader

    def tensor(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        return self.reader.get(name).to(device=self.device, dtype=dtype)

    def linear(self, prefix: str, *, rows: Sequence[Span] | None = None, columns: ColumnSlice | None = None) -> nn.Module:
        if self.has(f"{prefix}.{WEIGHT_SCALE}"):
            self.kinds.add("nvfp4")
            return read_linear(self.reader, prefix, rows=rows, columns=columns, device=self.device, kernels=self.kernels)
        if rows is not None or columns is not None:
            raise CheckpointError(f"{prefix} is not an NVFP4 linear; only NVFP4 linears are read as tensor-parallel shards")
        self.kinds.add("dense")
        bias = self.tensor(f"{prefix}.{BIAS}") if self.has(f"{prefix}.{BIAS}") else None
        return DenseLinear(self.tensor(f"{prefix}.{WEIGHT}"), bias)
