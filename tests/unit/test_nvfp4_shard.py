"""Layout-preserving shards for every rank count 1..8, ragged partitions included."""

from __future__ import annotations

import pytest
import torch

from h3core.errors import NVFP4FormatError
from h3core.nvfp4.codec import dequantize, global_scale_for, quantize
from h3core.nvfp4.layout import ColumnSlice
from h3core.nvfp4.linear import NVFP4Linear
from h3core.nvfp4.shard import column_parallel, row_parallel, select_columns, select_rows
from h3core.parallel.partition import fused_qkv_rows, gate_up_rows, head_column_slices, head_spans, nvfp4_column_slices
from h3core.span import Span

HEADS, HEAD_DIM = 12, 16  # hidden 192; 12 heads are ragged over 5, 7 and 8 ranks
HIDDEN = HEADS * HEAD_DIM
MLP = 13 * 16  # 13 blocks: ragged over every count but 1
COUNTS = range(1, 9)


def linear(out: int, inp: int, seed: int, pre_quant_scale: bool = False) -> NVFP4Linear:
    gen = torch.Generator().manual_seed(seed)
    weight, bias = torch.randn(out, inp, generator=gen), torch.randn(out, generator=gen)
    base = NVFP4Linear.from_float(weight, bias)
    pre = torch.rand(inp, generator=gen) + 0.5 if pre_quant_scale else None
    return NVFP4Linear(base.nvfp4, base.bias, pre)


def fused_qkv() -> NVFP4Linear:
    gen = torch.Generator().manual_seed(7)
    parts = [torch.randn(HIDDEN, HIDDEN, generator=gen) * scale for scale in (1.0, 2.0, 0.5)]
    return NVFP4Linear.from_float(torch.cat(parts), torch.randn(3 * HIDDEN, generator=gen), global_scale_for(*parts))


QKV, ATTN_OUT = fused_qkv(), linear(HIDDEN, HIDDEN, 1, pre_quant_scale=True)
FC1, FC2 = linear(2 * MLP, HIDDEN, 2), linear(HIDDEN, MLP, 3)


def owns_its_bytes(t: torch.Tensor) -> bool:
    return t.untyped_storage().nbytes() == t.numel() * t.element_size()


def assert_rows_preserved(full: NVFP4Linear, shard: NVFP4Linear, rows: list[Span]) -> None:
    def pick(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t[s.start : s.stop] for s in rows])

    assert torch.equal(shard.weight, pick(full.weight))  # the very bytes
    assert torch.equal(shard.weight_scale.view(torch.uint8), pick(full.weight_scale.view(torch.uint8)))
    assert torch.equal(shard.weight_scale_2, full.weight_scale_2)
    assert torch.equal(dequantize(shard.nvfp4), pick(dequantize(full.nvfp4)))  # exactly
    assert torch.equal(shard.bias, pick(full.bias))
    assert owns_its_bytes(shard.weight) and owns_its_bytes(shard.weight_scale)


@pytest.mark.parametrize("world", COUNTS)
def test_qkv_rows_by_head_ownership(world):
    spans = head_spans(HEADS, world)
    for heads in spans:
        rows = fused_qkv_rows(heads, HEADS, HEAD_DIM)
        assert_rows_preserved(QKV, column_parallel(QKV, rows), rows)
    owned = sorted(
        r for heads in spans for span in fused_qkv_rows(heads, HEADS, HEAD_DIM) for r in range(span.start, span.stop)
    )
    assert owned == list(range(3 * HIDDEN))


@pytest.mark.parametrize("world", COUNTS)
def test_fc1_gate_and_value_halves_match_fc2_columns(world):
    for cols in nvfp4_column_slices(MLP, world):
        rows = gate_up_rows(cols, MLP)
        assert_rows_preserved(FC1, column_parallel(FC1, rows), rows)


def assert_columns_preserved(full: NVFP4Linear, shard: NVFP4Linear, cols: ColumnSlice) -> None:
    b, s, e = cols.packed_bytes, cols.scale_columns, cols.elements
    assert torch.equal(shard.weight, full.weight[:, b.start : b.stop])
    assert torch.equal(shard.weight_scale.view(torch.uint8), full.weight_scale.view(torch.uint8)[:, s.start : s.stop])
    assert torch.equal(shard.weight_scale_2, full.weight_scale_2)
    assert torch.equal(dequantize(shard.nvfp4), dequantize(full.nvfp4)[:, e.start : e.stop])
    assert shard.bias is None
    assert owns_its_bytes(shard.weight) and owns_its_bytes(shard.weight_scale)


@pytest.mark.parametrize("world", COUNTS)
@pytest.mark.parametrize("name", ["attn_out", "fc2"])
def test_row_parallel_partials_sum_to_the_full_matmul(world, name):
    full, slices = {
        "attn_out": (ATTN_OUT, head_column_slices(HEADS, HEAD_DIM, world)),
        "fc2": (FC2, nvfp4_column_slices(MLP, world)),
    }[name]
    x = torch.randn(11, full.in_features, generator=torch.Generator().manual_seed(world))
    total = torch.zeros(11, full.out_features)
    for cols in slices:
        shard, bias = row_parallel(full, cols)
        assert_columns_preserved(full, shard, cols)
        assert torch.equal(bias, full.bias)
        if full.pre_quant_scale is not None:
            assert torch.equal(shard.pre_quant_scale, full.pre_quant_scale[cols.elements.start : cols.elements.stop])
        total += shard(x[:, cols.elements.start : cols.elements.stop])
    total += bias  # once, after the reduction
    torch.testing.assert_close(total, full(x), rtol=1e-5, atol=1e-4)


def test_column_parallel_keeps_the_whole_pre_quant_scale():
    rows = [Span(0, 16)]
    shard = column_parallel(ATTN_OUT, rows)
    assert torch.equal(shard.pre_quant_scale, ATTN_OUT.pre_quant_scale)


def test_select_functions_work_on_bare_weights():
    w = QKV.nvfp4
    rows = [Span(16, 32), Span(HIDDEN + 16, HIDDEN + 32)]
    assert select_rows(w, rows).out_features == 32
    cols = nvfp4_column_slices(HIDDEN, 5)[3]
    assert select_columns(w, cols).in_features == len(cols.elements)


@pytest.mark.parametrize(
    "cols, message",
    [
        (ColumnSlice(Span(8, 64)), "split a 16-element"),
        (ColumnSlice(Span(0, 40)), "split a 16-element"),
        (ColumnSlice(Span(0, HIDDEN + 16)), "exceed"),
        (ColumnSlice(Span(32, 32)), "empty"),
    ],
)
def test_bad_column_cuts_are_refused(cols, message):
    with pytest.raises(NVFP4FormatError, match=message):
        row_parallel(ATTN_OUT, cols)


@pytest.mark.parametrize(
    "rows, message",
    [([Span(0, 3 * HIDDEN + 1)], "exceed"), ([], "non-empty"), ([Span(4, 4)], "non-empty")],
)
def test_bad_row_selections_are_refused(rows, message):
    with pytest.raises(NVFP4FormatError, match=message):
        column_parallel(QKV, rows)


def test_quantizing_a_slice_is_not_the_same_as_slicing_the_quantized_tensor():
    # Why shards slice bytes: re-quantizing a slice would pick its own global scale and other codes.
    weight = torch.cat([torch.randn(16, 32) * 0.01, torch.randn(16, 32)])
    sliced = select_rows(quantize(weight), [Span(0, 16)])
    requantized = quantize(weight[:16])
    assert not torch.equal(sliced.global_scale, requantized.global_scale)
