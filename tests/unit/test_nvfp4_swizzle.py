"""The 128x4 block-scale swizzle against the cuBLAS layout formula, and the fp4 GEMM's call contract."""

from __future__ import annotations

import pytest
import torch

from h3core.nvfp4.codec import quantize
from h3core.nvfp4.matmul import fp4_linear, scaled_mm_fp4
from h3core.nvfp4.swizzle import swizzle_block_scales, swizzled_size, unswizzle_block_scales


def cublas_offset(row: int, col: int, col_tiles: int) -> int:
    """cuBLAS docs, "1D block scaling factors layout": 512-byte tiles of 128 rows x 4 columns."""
    tile = (row // 128) * col_tiles + col // 4
    return tile * 512 + (row % 32) * 16 + ((row % 128) // 32) * 4 + col % 4


@pytest.mark.parametrize("rows, cols", [(128, 4), (256, 8), (130, 6), (1, 1), (300, 13)])
def test_swizzle_puts_every_scale_where_cublas_reads_it(rows, cols):
    values = torch.randint(1, 255, (rows, cols), dtype=torch.uint8)
    values[values == 0x7F] = 1  # stay off NaN
    scale = values.view(torch.float8_e4m3fn)
    flat = swizzle_block_scales(scale)
    assert flat.dtype == torch.float8_e4m3fn and flat.dim() == 1
    assert flat.numel() == swizzled_size(rows, cols) == (-(-rows // 128) * 128) * (-(-cols // 4) * 4)
    col_tiles = -(-cols // 4)
    raw = flat.view(torch.uint8)
    expected = torch.zeros_like(raw)
    for r in range(rows):
        for c in range(cols):
            expected[cublas_offset(r, c, col_tiles)] = values[r, c]
    assert torch.equal(raw, expected)  # also: the padding is zero


@pytest.mark.parametrize("rows, cols", [(128, 4), (257, 9), (5, 3)])
def test_unswizzle_inverts_swizzle(rows, cols):
    scale = torch.rand(rows, cols).mul(400).to(torch.float8_e4m3fn)
    back = unswizzle_block_scales(swizzle_block_scales(scale), rows, cols)
    assert torch.equal(back.view(torch.uint8), scale.view(torch.uint8))


def test_unswizzle_rejects_a_wrong_size():
    with pytest.raises(ValueError, match="cannot hold"):
        unswizzle_block_scales(torch.zeros(100, dtype=torch.uint8), 128, 4)


@pytest.mark.parametrize("m, k, n", [(128, 64, 128), (45, 96, 1024), (2, 1024, 144), (197, 224, 272)])
def test_fp4_operands_satisfy_scaled_mm_contract(m, k, n):
    # torch's meta kernel for _scaled_mm runs the CUDA-side checks (row/column-major operands, K and N
    # multiples of 16 packed, swizzled scale sizes and contiguity), so the call is checked on the CPU.
    weight = quantize(torch.randn(n, k)).to("meta")
    act = quantize(torch.randn(m, k)).to("meta")
    out = scaled_mm_fp4(act.packed, swizzle_block_scales(act.scale), weight.packed, swizzle_block_scales(weight.scale))
    assert out.shape == (m, n) and out.dtype == torch.bfloat16


def test_unswizzled_scales_break_the_contract():
    weight = quantize(torch.randn(256, 64)).to("meta")
    with pytest.raises(RuntimeError, match="scale_a should have"):
        scaled_mm_fp4(weight.packed[:100], weight.scale[:100].reshape(-1), weight.packed, swizzle_block_scales(weight.scale))


def test_full_fp4_linear_runs_on_meta():
    weight = quantize(torch.randn(96, 64)).to("meta")
    x = torch.empty(7, 64, dtype=torch.bfloat16, device="meta")
    bias = torch.empty(96, dtype=torch.bfloat16, device="meta")
    for input_scale in (None, torch.tensor(0.01, device="meta")):
        y = fp4_linear(x, weight, swizzle_block_scales(weight.scale), bias, input_scale)
        assert y.shape == (7, 96) and y.dtype == torch.bfloat16
