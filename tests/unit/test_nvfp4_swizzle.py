"""The 128x4 block-scale swizzle against the cuBLAS layout formula."""

from __future__ import annotations

import pytest
import torch

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
