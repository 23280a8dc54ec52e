"""NVFP4 block geometry, in pure Python.

An NVFP4 linear of shape `out x in` stores, per row, `in / 2` bytes of packed E2M1 codes (two
elements per byte, element `2j` in the low nibble) and `in / 16` float8-e4m3 block scales. A
column range of the dense weight maps to a byte range and a scale-column range only when both
ends sit on a 16-element block boundary; everything here checks that (`ColumnSlice`).

ColumnSlice is a small frozen pydantic dataclass (torch-free) so that plans and reports carry it as
it is. Everything outside `h3core.nvfp4` that needs a width, a byte count or an alignment of the format
asks this module (the model config's widths, the checkpoint's byte accounting, the text encoder's
shapes, the partition of input columns).
"""

from __future__ import annotations

from pydantic import computed_field
from pydantic.dataclasses import dataclass

from h3core.errors import NVFP4FormatError
from h3core.span import Span

BLOCK_ELEMENTS = 16
"""Elements along the input (K) axis that share one fp8 block scale."""

ELEMENTS_PER_BYTE = 2
"""Two 4-bit codes per packed byte."""

BLOCK_BYTES = BLOCK_ELEMENTS // ELEMENTS_PER_BYTE
"""Packed bytes of one block: 8."""

GLOBAL_SCALE_BYTES = 4
"""The float32 global scale (`weight_scale_2`) of one weight."""

BIAS_BYTES = 2
"""An NVFP4 linear's bias is unquantized; h3 checkpoints store it in bf16."""


def is_block_aligned(width: int) -> bool:
    """True when `width` elements are a whole number of NVFP4 blocks (16 each)."""
    return width % BLOCK_ELEMENTS == 0


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


def packed_columns(width: int) -> int:
    """Byte columns of the packed `weight` of a linear with `width` inputs (two codes per byte)."""
    return width // ELEMENTS_PER_BYTE


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


def linear_bytes(rows: int, cols: int, bias: bool) -> int:
    """Stored bytes of a `rows x cols` NVFP4 linear: `storage_bytes` and, with `bias`, its bf16 bias."""
    return storage_bytes(rows, cols) + (rows * BIAS_BYTES if bias else 0)


@dataclass(frozen=True)
class ColumnSlice:
    """A block-aligned slice of the input (K) axis of an NVFP4 weight, in the three units that address it.

    Reports carry all three (`elements`, `packed_bytes`, `scale_columns`); the last two follow from
    the first, and asking for them raises `NVFP4FormatError` unless both ends sit on block boundaries.
    """

    elements: Span
    """Dense input columns `[start, stop)`; both ends are multiples of the block size."""

    @computed_field  # type: ignore[prop-decorator]
    @property
    def packed_bytes(self) -> Span:
        """Columns of the packed `uint8` weight (two codes per byte)."""
        return Span(packed_bytes(self.elements.start), packed_bytes(self.elements.stop))

    @computed_field  # type: ignore[prop-decorator]
    @property
    def scale_columns(self) -> Span:
        """Columns of the fp8 `weight_scale` (one per block)."""
        return Span(scale_columns(self.elements.start), scale_columns(self.elements.stop))

    @property
    def blocks(self) -> int:
        return len(self.scale_columns)


def column_slice(elements: Span) -> ColumnSlice:
    """Wrap an element span as a column slice, naming which end is not block aligned."""
    check_column_cut(elements.start, "column slice start")
    check_column_cut(elements.stop, "column slice end")
    return ColumnSlice(elements)
