"""NVFP4 block geometry, in pure Python.

An NVFP4 linear of shape `out x in` stores, per row, `in / 2` bytes of packed E2M1 codes (two
elements per byte, element `2j` in the low nibble) and `in / 16` float8-e4m3 block scales. A
column range of the dense weight maps to a byte range and a scale-column range only when both
ends sit on a 16-element block boundary; everything here checks that.
"""

from __future__ import annotations

from h3core.errors import NVFP4FormatError

BLOCK_ELEMENTS = 16
"""Elements along the input (K) axis that share one fp8 block scale."""

ELEMENTS_PER_BYTE = 2
"""Two 4-bit codes per packed byte."""

BLOCK_BYTES = BLOCK_ELEMENTS // ELEMENTS_PER_BYTE
"""Packed bytes of one block: 8."""


def check_width(width: int, what: str = "input width") -> int:
    """Return the number of blocks in `width`, or raise if it is not a whole number of blocks."""
    if width <= 0 or width % BLOCK_ELEMENTS:
        raise NVFP4FormatError(
            f"{what} {width} is not a positive multiple of {BLOCK_ELEMENTS}: NVFP4 stores one "
            f"scale per {BLOCK_ELEMENTS} input elements; pad the layer's input width in the model"
        )
    return width // BLOCK_ELEMENTS


def check_column_cut(column: int, what: str = "column cut") -> None:
    """Raise unless `column` lies on a block boundary."""
    if column % BLOCK_ELEMENTS:
        raise NVFP4FormatError(
            f"{what} at element {column} would split a {BLOCK_ELEMENTS}-element NVFP4 block; "
            f"cuts must be multiples of {BLOCK_ELEMENTS}"
        )


def packed_bytes(elements: int) -> int:
    """Packed bytes holding `elements` codes of one row (`elements` must be block aligned)."""
    check_column_cut(elements, "element count")
    return elements // ELEMENTS_PER_BYTE


def unpacked_width(packed_columns: int) -> int:
    """The input width of a linear whose packed `weight` has `packed_columns` byte columns."""
    return packed_columns * ELEMENTS_PER_BYTE


def scale_columns(elements: int) -> int:
    """Block-scale columns covering `elements` codes of one row (block aligned)."""
    check_column_cut(elements, "element count")
    return elements // BLOCK_ELEMENTS


def storage_bytes(rows: int, cols: int) -> int:
    """Bytes of packed codes + fp8 block scales + the float32 global scale of a `rows x cols` weight."""
    check_width(cols)
    return rows * (packed_bytes(cols) + scale_columns(cols)) + 4
