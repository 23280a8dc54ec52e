"""What `--compile` did in one request, as the report records it (h3core.model.compiled).

Compilation happens inside the first call of each new input shape, so inside a step: the record
keeps the seconds each step spent compiling, and the step times without them, so that compile time
and step time are read apart (a resident server compiles once per shape, not per request).
"""

from __future__ import annotations

from statistics import median

from pydantic import BaseModel, Field


class CompileRecord(BaseModel):
    """One rank's compile time in one request, step by step."""

    fullgraph: bool = Field(description="True: one graph per block forward (no collective inside); False: the pieces between the collectives.")
    step_compile_seconds: list[float] = Field(description="Seconds each step spent compiling (0: every shape was compiled already).")
    step_seconds: list[float] = Field(description="Each step's seconds without its compile time.")

    @property
    def seconds(self) -> float:
        return sum(self.step_compile_seconds)

    def line(self) -> str:
        steps = [str(i + 1) for i, s in enumerate(self.step_compile_seconds) if s > 0]
        where = f"in step{'s' if len(steps) > 1 else ''} {', '.join(steps)}" if steps else "nothing new to compile"
        run = median(self.step_seconds) if self.step_seconds else 0.0
        graphs = "one graph per block" if self.fullgraph else "the pieces between collectives"
        return f"{self.seconds:.2f}s compiling ({where}; {graphs}) · median step without it {run:.3f}s"


def slowest(records: list["CompileRecord | None"]) -> "CompileRecord | None":
    """The rank that spent the longest compiling (None: the run did not compile)."""
    present = [r for r in records if r is not None]
    return max(present, key=lambda r: r.seconds) if present else None
