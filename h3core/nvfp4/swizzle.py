"""The 128x4 swizzled block-scale layout that Blackwell block-scaled GEMMs read.

cuBLAS ("1D block scaling factors layout") and CUTLASS read NVFP4 block scales in tiles of 128 rows
x 4 scale columns. The scale matrix `[rows, cols]` is zero-padded to multiples of (128, 4); tiles
are laid out row-tile major (all column tiles of rows 0..127 first); inside a tile the scale of
row `r` and column `c` sits at offset `(r % 32) * 16 + (r // 32) * 4 + c`. So, in one tile, the 4
scales of row r, then those of row r + 32, r + 64, r + 96 make one contiguous 16-byte line.

This layout exists only in memory, built at load time; files keep the row-major ModelOpt layout.
Pure reshuffling: runs anywhere, tested on the CPU.
"""

from __future__ import annotations

import torch

TILE_ROWS = 128
"""Rows of one scale tile."""

TILE_COLUMNS = 4
"""Scale columns (of 16 elements each: 64 input elements) of one tile."""

_SUBTILE_ROWS = 32
"""Rows interleaved inside a tile: rows r, r+32, r+64, r+96 share one 16-byte line."""


def swizzled_size(rows: int, cols: int) -> int:
    """Elements of the swizzled layout of a `[rows, cols]` scale matrix (padding included)."""
    return _ceil_to(rows, TILE_ROWS) * _ceil_to(cols, TILE_COLUMNS)


def swizzle_block_scales(scale: torch.Tensor) -> torch.Tensor:
    """Flat swizzled copy (same dtype, padded with zeros) of a row-major `[rows, cols]` scale matrix."""
    rows, cols = scale.shape
    row_tiles, col_tiles = _ceil_to(rows, TILE_ROWS) // TILE_ROWS, _ceil_to(cols, TILE_COLUMNS) // TILE_COLUMNS
    raw = scale.view(torch.uint8)  # reshuffle bytes: not every dtype has every kernel
    padded = raw.new_zeros(row_tiles * TILE_ROWS, col_tiles * TILE_COLUMNS)
    padded[:rows, :cols] = raw
    # [row tile, row // 32 within tile, row % 32, col tile, col within tile]
    tiles = padded.view(row_tiles, TILE_ROWS // _SUBTILE_ROWS, _SUBTILE_ROWS, col_tiles, TILE_COLUMNS)
    swizzled = tiles.permute(0, 3, 2, 1, 4).contiguous()  # [row tile, col tile, r % 32, r // 32, c]
    return swizzled.view(-1).view(scale.dtype)


def unswizzle_block_scales(swizzled: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Inverse of `swizzle_block_scales`: the row-major `[rows, cols]` matrix, padding dropped."""
    row_tiles, col_tiles = _ceil_to(rows, TILE_ROWS) // TILE_ROWS, _ceil_to(cols, TILE_COLUMNS) // TILE_COLUMNS
    if swizzled.numel() != swizzled_size(rows, cols):
        raise ValueError(f"{swizzled.numel()} swizzled scales cannot hold a [{rows}, {cols}] matrix")
    raw = swizzled.reshape(-1).view(torch.uint8)
    tiles = raw.view(row_tiles, col_tiles, _SUBTILE_ROWS, TILE_ROWS // _SUBTILE_ROWS, TILE_COLUMNS)
    padded = tiles.permute(0, 3, 2, 1, 4).reshape(row_tiles * TILE_ROWS, col_tiles * TILE_COLUMNS)
    return padded[:rows, :cols].contiguous().view(swizzled.dtype)


def _ceil_to(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple
