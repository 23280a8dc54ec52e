"""The packed sequence's layout (DESIGN.md §2): `text | video | audio` segments back to back, no padding.

A segment is `(kind, start, stop)` over the packed sequence. Pure Python (no torch): the model
config, the partition and `h3 plan` speak it before anything heavy is imported. `Segment` is a
frozen dataclass: plans and reports serialise it as `{"kind", "start", "stop"}`.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from h3core.span import Span


class SegmentKind(str, Enum):
    TEXT = "text"
    VIDEO = "video"
    AUDIO = "audio"

    def __str__(self) -> str:  # 'text' in messages and tables, as the value reports carry
        return self.value


@dataclass(frozen=True)
class Segment:
    """`kind` tokens at rows `[start, stop)` of a packed sequence."""

    kind: SegmentKind
    start: int
    stop: int

    def __len__(self) -> int:
        return self.stop - self.start

    @property
    def span(self) -> Span:
        return Span(self.start, self.stop)


def pack_segments(lengths: list[tuple[SegmentKind, int]]) -> list[Segment]:
    """Lay segments back to back in the given order, with no padding; empty ones are dropped."""
    segments, start = [], 0
    for kind, length in lengths:
        if length < 0:
            raise ValueError(f"negative segment length {length} for {kind.value}")
        if length:
            segments.append(Segment(kind, start, start + length))
            start += length
    return segments


KINDS = (SegmentKind.TEXT, SegmentKind.VIDEO, SegmentKind.AUDIO)
KIND_INDEX = {kind: i for i, kind in enumerate(KINDS)}
LATENT_KINDS = (SegmentKind.VIDEO, SegmentKind.AUDIO)
