"""`Span`: a half-open range `[start, stop)` of items (heads, tokens, rows, columns).

The unit every split in h3 is written in (the partition contract, NVFP4 shards, collectives'
splits, a checkpoint reader's row ranges). A frozen dataclass: pydantic reports serialise it as
`{"start": a, "stop": b}` and read it back checked, and it pickles to the ranks as it is.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Span:
    """A half-open range `[start, stop)` of items, `0 <= start <= stop`."""

    start: int
    stop: int

    def __post_init__(self) -> None:
        if not 0 <= self.start <= self.stop:
            raise ValueError(f"invalid span [{self.start}, {self.stop})")

    def __len__(self) -> int:
        return self.stop - self.start

    def scaled(self, factor: int) -> "Span":
        """The same range in units `factor` times smaller (heads -> elements of width factor)."""
        return Span(self.start * factor, self.stop * factor)

    def shifted(self, offset: int) -> "Span":
        return Span(self.start + offset, self.stop + offset)

    def overlap(self, other: "Span") -> int:
        """How many items the two spans share."""
        return max(0, min(self.stop, other.stop) - max(self.start, other.start))

    def as_list(self) -> list[int]:
        return [self.start, self.stop]

    def __str__(self) -> str:
        return f"{self.start}:{self.stop}"
