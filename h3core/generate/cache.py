"""What a request's step cache did, as the report records it (`--cache`; h3core.model.step_cache)."""

from __future__ import annotations

import math

from pydantic import BaseModel, Field, field_serializer


class SequenceCacheRecord(BaseModel):
    """One sequence's steps: which skipped blocks 1.., and each step's agreed change of block 0's residual."""

    skipped: list[int] = Field(description="Steps (0-based forwards) that ran block 0 only and reused the other blocks' residual.")
    changes: list[float | None] = Field(description="Each step's change of block 0's residual since the last full step (None: the first, nothing to compare).")

    @field_serializer("changes")
    def _finite(self, changes: list[float | None]) -> list[float | None]:
        return [None if c is None or not math.isfinite(c) else c for c in changes]


class CacheRecord(BaseModel):
    """The step cache of one request on one rank (every rank of a sequence took the same decisions)."""

    policy: str = Field(description="off, or fbcache:THRESHOLD.")
    steps: int = Field(description="Forwards per sequence.")
    sequences: dict[str, SequenceCacheRecord] = Field(description="Per sequence (prompt, negative prompt): what the cache did.")

    @property
    def skipped(self) -> int:
        """Forwards whose blocks 1.. were skipped, over every sequence."""
        return sum(len(s.skipped) for s in self.sequences.values())

    @property
    def computed(self) -> int:
        return self.steps * len(self.sequences) - self.skipped

    def line(self) -> str:
        return f"{self.policy}: {self.computed} forwards computed, {self.skipped} skipped" + (
            " (" + "; ".join(f"{name}: steps {', '.join(str(i + 1) for i in s.skipped) or 'none'} skipped" for name, s in self.sequences.items()) + ")")
