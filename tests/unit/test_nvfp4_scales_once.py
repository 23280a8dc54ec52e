"""An NVFP4Linear holds its block scales once, in the form its path reads: swizzled only on the fp4
paths, row-major only on the dequant paths; files, state dicts and shards still see ModelOpt's
row-major `weight_scale`, bit for bit, and the module converts when its path changes."""

from __future__ import annotations

import pytest
import torch

from h3core.nvfp4 import layout
from h3core.nvfp4.codec import dequantize
from h3core.nvfp4.io import linear_tensors
from h3core.nvfp4.linear import NVFP4Linear
from h3core.nvfp4.matmul import PATH_CPU_DEQUANT, PATH_CPU_FP4_EMULATED, fp4_gemm_shape
from h3core.nvfp4.shard import column_parallel, row_parallel
from h3core.nvfp4.swizzle import swizzled_size
from h3core.parallel.partition import nvfp4_column_slices
from h3core.span import Span

H3_BLOCK_LINEARS = {"qkv": (21504, 5376), "out": (5376, 7168), "fc1": (28672, 5376), "fc2": (5376, 14336)}
"""(out, in) of one H3 block's four NVFP4 linears (MINIMAX_H3.md §5); 50 blocks: the 200 of the file."""


def make(out: int = 160, inp: int = 208, seed: int = 0, emulate: bool = True) -> NVFP4Linear:
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(out, inp, generator=gen) * torch.logspace(-2, 1, out).unsqueeze(1)
    linear = NVFP4Linear.from_float(weight, torch.randn(out, generator=gen))
    linear.emulate_fp4 = emulate
    return linear


def scale_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("out, inp", [(160, 208), (256, 512), (40, 16)])
def test_the_fp4_path_holds_only_the_swizzled_scales(out, inp):
    linear = make(out, inp)
    original = linear.weight_scale.clone()
    linear.prepare()
    assert linear.path == PATH_CPU_FP4_EMULATED and linear.weight_scale is None and linear.prepared
    rows, width = fp4_gemm_shape(out, inp)
    assert linear.swizzled_weight_scale.numel() == swizzled_size(rows, layout.scale_columns(width))
    held = {name for name, buf in linear.named_buffers()}
    assert "weight_scale" not in held and "swizzled_weight_scale" in held
    assert scale_bytes(linear.block_scales) == scale_bytes(original) == scale_bytes(linear.nvfp4.scale)


def test_state_dict_and_files_carry_the_row_major_scales_in_modelopt_order():
    plain, prepared = make(emulate=False), make()
    plain.prepare()
    prepared.prepare()
    assert plain.weight_scale is not None and plain.swizzled_weight_scale is None
    a, b = plain.state_dict(), prepared.state_dict()
    assert list(a) == list(b) == ["weight", "weight_scale", "weight_scale_2", "bias"]
    assert all(scale_bytes(a[k]) == scale_bytes(b[k]) for k in a)
    assert linear_tensors("x", prepared)["x.weight_scale"].dtype == torch.float8_e4m3fn


def test_loading_into_a_prepared_module_and_forward_again():
    source, target = make(seed=1), make(seed=2)
    target.prepare()
    target.load_state_dict(source.state_dict())  # strict: weight_scale is expected and found
    x = torch.randn(7, source.in_features, generator=torch.Generator().manual_seed(3))
    assert torch.equal(target(x), source(x))
    assert target.weight_scale is None and target.prepared  # prepared again by its forward


def test_a_module_whose_path_changes_converts_its_scales():
    linear = make()
    original = scale_bytes(linear.weight_scale)
    x = torch.randn(5, linear.in_features, generator=torch.Generator().manual_seed(4))
    linear(x)
    assert linear.weight_scale is None
    linear.emulate_fp4 = False  # the path is now cpu-dequant: row-major scales again, swizzled gone
    assert linear.path == PATH_CPU_DEQUANT
    y = linear(x)
    assert linear.swizzled_weight_scale is None and scale_bytes(linear.weight_scale) == original
    assert torch.equal(y, torch.nn.functional.linear(x, dequantize(linear.nvfp4)) + linear.bias)  # the bias after the GEMM


def test_shards_of_a_prepared_module_are_the_slices_of_its_row_major_scales(monkeypatch):
    monkeypatch.setattr(NVFP4Linear, "emulate_fp4", True)  # the shards' path too
    full = make(256, 13 * 16)
    original = full.weight_scale.clone()
    full.prepare()
    rows = [Span(0, 64), Span(128, 192)]
    col = column_parallel(full, rows)
    assert scale_bytes(col.block_scales) == scale_bytes(torch.cat([original[0:64], original[128:192]]))
    for cols in nvfp4_column_slices(full.in_features, 3):
        shard, _ = row_parallel(full, cols)
        assert shard.weight_scale is None  # prepared for its path too
        want = original[:, cols.scale_columns.start : cols.scale_columns.stop]
        assert scale_bytes(shard.block_scales) == scale_bytes(want)


def test_resident_bytes_fall_by_the_row_major_scales():
    linear = make(256, 512)
    row_major = linear.weight_scale.numel()
    linear.prepare()
    before = linear.resident_bytes + row_major  # what the module held when it kept both forms
    assert before - linear.resident_bytes == 256 * 512 // 16


def test_h3_saves_1_2_gb_per_ulysses_rank():
    """Every Ulysses rank holds all 200 block linears; at H3's shapes the swizzled layout needs no
    padding, so the row-major copy it no longer keeps is exactly out * in / 16 bytes per linear."""
    saved = 0
    for out, inp in H3_BLOCK_LINEARS.values():
        rows, width = fp4_gemm_shape(out, inp)
        assert swizzled_size(rows, layout.scale_columns(width)) == out * layout.scale_columns(inp)  # no padding
        saved += 50 * out * layout.scale_columns(inp)
    assert saved == 1_204_224_000
