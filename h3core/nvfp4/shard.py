"""Layout-preserving tensor-parallel shards of NVFP4 weights.

A shard is made of the very bytes of the full tensors: rows of `weight` and `weight_scale`
(column-parallel), or block-aligned column ranges of them (row-parallel: `k/2` packed bytes and
`k/16` scale columns per element range `k`). The global scale is shared and unchanged, so
`dequantize(shard)` is exactly the matching slice of `dequantize(full)`.

Ranges always come from the parallel plan (`Span`, `ColumnSlice`); nothing here decides a split.
Every shard owns compact copies of its bytes, so dropping the full tensors frees their memory,
and is prepared for its device's matmul path (`NVFP4Linear.prepare`) before it is returned. The
input scale is the full linear's: one value for the whole logical input, on every rank.
"""

from __future__ import annotations

from typing import Sequence

import torch

from h3core.errors import NVFP4FormatError
from h3core.nvfp4.codec import NVFP4Weight
from h3core.nvfp4.linear import NVFP4Linear
from h3core.nvfp4.layout import ColumnSlice
from h3core.span import Span


def select_rows(w: NVFP4Weight, rows: Sequence[Span]) -> NVFP4Weight:
    """Rows `rows` of `w`, concatenated in order (q|k|v thirds, gate|value halves); same global scale."""
    check_rows(rows, w.out_features)
    return NVFP4Weight(take_rows(w.packed, rows), take_rows(w.scale, rows), w.global_scale.clone())


def select_columns(w: NVFP4Weight, cols: ColumnSlice) -> NVFP4Weight:
    """Input columns `cols` of `w`: its packed-byte and scale-column ranges; same global scale."""
    check_columns(cols, w.in_features)
    return NVFP4Weight(
        take_columns(w.packed, cols.packed_bytes), take_columns(w.scale, cols.scale_columns), w.global_scale.clone()
    )


def column_parallel(linear: NVFP4Linear, rows: Sequence[Span]) -> NVFP4Linear:
    """The output rows `rows` of `linear`: weight, scales and bias sliced; pre-scale and input scale whole."""
    check_rows(rows, linear.out_features)
    bias = None if linear.bias is None else take_rows(linear.bias, rows)
    shard = NVFP4Linear(select_rows(linear.nvfp4, rows), bias, _copy(linear.pre_quant_scale), _copy(linear.input_scale))
    shard.kernels = linear.kernels
    shard.prepare()
    return shard


def row_parallel(linear: NVFP4Linear, cols: ColumnSlice) -> tuple[NVFP4Linear, torch.Tensor | None]:
    """The input columns `cols` of `linear`, without bias, and the full bias to add once after the reduction.

    Each rank computes `x[:, cols] @ W[:, cols].T`; summing the partials over ranks gives `x @ W.T`.
    The bias must be added once to the sum, not once per rank, so the shard has none.
    """
    check_columns(cols, linear.in_features)
    pre_scale = None if linear.pre_quant_scale is None else take_columns(linear.pre_quant_scale, cols.elements)
    shard = NVFP4Linear(select_columns(linear.nvfp4, cols), None, pre_scale, _copy(linear.input_scale))
    shard.kernels = linear.kernels
    shard.prepare()
    return shard, _copy(linear.bias)


def check_rows(rows: Sequence[Span], out_features: int) -> None:
    if not rows or any(len(span) == 0 for span in rows):
        raise NVFP4FormatError(f"a row selection needs one or more non-empty spans, got {list(rows)}")
    for span in rows:
        if span.stop > out_features:
            raise NVFP4FormatError(f"rows [{span.start}, {span.stop}) exceed the weight's {out_features} output rows")


def check_columns(cols: ColumnSlice, in_features: int) -> None:
    cols.packed_bytes  # raises NVFP4FormatError unless both ends sit on 16-element blocks
    if len(cols.elements) == 0 or cols.elements.stop > in_features:
        raise NVFP4FormatError(
            f"columns [{cols.elements.start}, {cols.elements.stop}) are empty or exceed the weight's "
            f"{in_features} inputs"
        )


def take_rows(t: torch.Tensor, rows: Sequence[Span]) -> torch.Tensor:
    """A compact copy of rows `rows` of `t` (dim 0), concatenated in order."""
    return torch.cat([t[span.start : span.stop] for span in rows], dim=0)


def take_columns(t: torch.Tensor, cols: Span) -> torch.Tensor:
    """A compact copy of columns `cols` of `t` (its last dim)."""
    return t[..., cols.start : cols.stop].clone(memory_format=torch.contiguous_format)


def _copy(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.clone()
