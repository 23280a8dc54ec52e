"""The partition contract (DESIGN.md §3): how heads, tokens, segments and NVFP4 columns split.

Everything that decides "which rank owns what" asks this module; nothing else does the
arithmetic (the parallel plan, `h3core.parallel.plan`, applies it to one run once, and every rank takes its
spans and shards from that plan). Pure Python, no torch, so it is cheap to import and to test.

Rule for every split: `q, r = divmod(n, world)`; rank `i` owns `q + 1` items if `i < r`, else
`q`; ranges are contiguous and in rank order. A split that would leave a rank empty is an
error, raised before any process exists. Nothing is ever padded to make shapes divide.
"""

from __future__ import annotations

from h3core.errors import PartitionError
from h3core.model.sequence import Segment, SegmentKind, kind_span
from h3core.nvfp4 import layout
from h3core.nvfp4.layout import ColumnSlice, column_slice
from h3core.span import Span


def balanced_sizes(n: int, world: int, what: str = "items") -> list[int]:
    """Sizes of the balanced split of `n` items over `world` ranks (first `n % world` get one more)."""
    if world < 1:
        raise PartitionError(f"world size must be at least 1, got {world}")
    if n < world:
        raise PartitionError(
            f"cannot split {n} {what} over {world} ranks: some rank would own none; "
            f"use at most {n} ranks"
        )
    q, r = divmod(n, world)
    return [q + 1 if rank < r else q for rank in range(world)]


def balanced_spans(n: int, world: int, what: str = "items") -> list[Span]:
    """Contiguous spans, in rank order, of the balanced split of `n` items over `world` ranks."""
    spans, start = [], 0
    for size in balanced_sizes(n, world, what):
        spans.append(Span(start, start + size))
        start += size
    return spans


def head_spans(num_heads: int, world: int) -> list[Span]:
    """Attention heads owned by each rank (56 over 6 ranks: 10, 10, 9, 9, 9, 9)."""
    return balanced_spans(num_heads, world, "attention heads")


def token_spans(num_tokens: int, world: int) -> list[Span]:
    """Rows of the packed sequence owned by each rank."""
    return balanced_spans(num_tokens, world, "tokens of the packed sequence")


def head_groups(heads: list[Span], groups: int) -> list[list[Span]]:
    """Ulysses overlap's head groups: group `g` holds, of every rank `j`, the `g`-th part of the
    balanced split of `heads[j]` into `groups` parts, so that each group's all-to-all is the whole
    one narrowed (every rank sends and receives in every group). At most as many groups as the
    fewest heads a rank holds; at least one (the whole all-to-all)."""
    count = max(1, min(groups, *(len(h) for h in heads)))
    parts = [[s.shifted(h.start) for s in balanced_spans(len(h), count, "heads")] for h in heads]
    return [[parts[j][g] for j in range(len(heads))] for g in range(count)]


# --- segments ----------------------------------------------------------------------------------


def clip_segments(segments: list[Segment], interval: Span) -> list[Segment]:
    """Segments restricted to `interval` and rebased by `-interval.start`.

    A segment that misses the interval disappears; one that straddles it is cut at its edges.
    The result describes the rows a rank holds, in that rank's local coordinates.
    """
    clipped = []
    for seg in segments:
        start, stop = max(seg.start, interval.start), min(seg.stop, interval.stop)
        if start < stop:
            clipped.append(seg.moved(start - interval.start, stop - interval.start))
    return clipped


def kind_rows(segments: list[Segment], interval: Span) -> dict[SegmentKind, Span]:
    """For each segment kind present in `interval`, which of that kind's own rows it covers.

    Rows of a kind are numbered from 0 at its first row (a kind's segments are contiguous: text may
    be several, one per run of equal tags): with `text[0:10] video[10:30]`, interval `[5, 15)`
    covers text rows `[5, 10)` and video rows `[0, 5)`.
    """
    out = {}
    for kind in dict.fromkeys(seg.kind for seg in segments):
        whole = kind_span(segments, kind)
        assert whole is not None
        start, stop = max(whole.start, interval.start), min(whole.stop, interval.stop)
        if start < stop:
            out[kind] = Span(start - whole.start, stop - whole.start)
    return out


def kind_spans(segments: list[Segment], token_spans: list[Span], kind: SegmentKind) -> list[Span]:
    """Per rank, the rows of `kind` it holds, in that kind's own coordinates (0 = its first row).

    The spans tile `[0, rows of kind)` in rank order; a rank holding none of the kind gets an
    empty span at the right place, so the list can drive a ragged gather of that kind's rows.
    """
    whole = kind_span(segments, kind)
    if whole is None:
        return [Span(0, 0) for _ in token_spans]

    def inside(row: int) -> int:
        return min(max(row, whole.start), whole.stop) - whole.start

    return [Span(inside(t.start), inside(t.stop)) for t in token_spans]


# --- NVFP4 column blocks -----------------------------------------------------------------------


def nvfp4_column_slices(width: int, world: int) -> list[ColumnSlice]:
    """Split `width` input columns over `world` ranks in whole NVFP4 blocks (quotient/remainder on blocks)."""
    blocks = layout.check_width(width)
    spans = balanced_spans(blocks, world, f"NVFP4 blocks of {layout.BLOCK_ELEMENTS} columns (width {width})")
    return [ColumnSlice(span.scaled(layout.BLOCK_ELEMENTS)) for span in spans]


def head_column_slices(num_heads: int, head_dim: int, world: int) -> list[ColumnSlice]:
    """Input columns of the attention output projection owned by each rank: its heads x head_dim.

    These follow head ownership (the attention output a rank holds is its heads only), so they
    are block aligned only when `head_dim` is a multiple of the block size; checked here.
    """
    return [column_slice(span.scaled(head_dim)) for span in head_spans(num_heads, world)]


def fused_qkv_rows(heads: Span, num_heads: int, head_dim: int) -> list[Span]:
    """Rows of a stacked `[q | k | v]` weight (`3 * num_heads * head_dim` rows) for `heads`, per third
    (a checkpoint that stores them otherwise, per head or as three tensors, maps these rows itself)."""
    width = num_heads * head_dim
    local = heads.scaled(head_dim)
    return [local.shifted(third * width) for third in range(3)]


def gate_up_rows(columns: ColumnSlice, ffn_dim: int) -> list[Span]:
    """Rows of a fused `[gate | up]` fc1 weight (`2 * ffn_dim` rows) matching fc2 `columns`."""
    return [columns.elements, columns.elements.shifted(ffn_dim)]
