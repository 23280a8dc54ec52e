"""What a check measures and reports: per-rank `Measure`s, combined into `CheckRow`s, and the report.

A rank compares its own share of a distributed result with the single-rank reference of the same
inputs and returns, per variant, the largest absolute error and the largest |reference| it saw.
Combining over ranks gives the row: `max_abs` = the largest error anywhere, `relative` =
`max_abs / max |reference|`. A row passes when `relative <= tolerance` and no rank noted a
mismatch that numbers cannot express (e.g. NVFP4 bytes that differ); tolerance 0 means bitwise.
Torch-free, so that the CLI can build and validate everything before importing torch.
"""

from __future__ import annotations

import math
from typing import Literal, Sequence

from pydantic import BaseModel, Field

from h3core.errors import CheckFailed
from h3core.reports.schema import Versions

Verdict = Literal["pass", "fail", "skip"]


class Measure(BaseModel):
    """One rank's comparison of one variant of a check (e.g. 'gather_rows' at 6 ranks, rank 3's rows)."""

    variant: str = Field(description="What was compared: a mode, a collective, a layer or a backend.")
    max_abs: float = Field(description="Largest |result - reference| this rank saw (NaN if the result had NaNs).")
    scale: float = Field(description="Largest |reference| this rank compared against.")
    tolerance: float = Field(description="Largest relative error that passes; 0 = bitwise.")
    seconds: float = Field(0.0, description="Wall time of this variant on this rank (distributed op + reference).")
    mismatches: list[str] = Field(default_factory=list, description="Failures numbers cannot express (bytes that differ, errors).")
    worst: str = Field("", description="Which case gave max_abs, when a variant covers several.")

    def merged(self, other: "Measure") -> "Measure":
        """Both comparisons as one (same variant): the larger error, the larger scale, all mismatches."""
        worst = self.worst if _ge(self.max_abs, other.max_abs) else other.worst
        return self.model_copy(
            update={
                "max_abs": _nan_max(self.max_abs, other.max_abs),
                "scale": max(self.scale, other.scale),
                "seconds": self.seconds + other.seconds,
                "mismatches": self.mismatches + other.mismatches,
                "worst": worst,
            }
        )


def _nan_max(a: float, b: float) -> float:
    return math.nan if math.isnan(a) or math.isnan(b) else max(a, b)


def _ge(a: float, b: float) -> bool:
    return math.isnan(a) or (not math.isnan(b) and a >= b)


class CheckRow(BaseModel):
    """One line of the verify table: one variant of one check at one rank count."""

    check: str = Field(description="transport, sdpa, ragged, projection, tp, nvfp4, parity or backends.")
    mode: str = Field(description="The variant: distributed mode, collective, layer, shard kind or attention backend.")
    count: int = Field(description="Ranks the variant ran on (1 for single-rank comparisons).")
    backend: str = Field(description="Process-group backend: gloo, nccl, or none at one rank.")
    dtype: str = Field(description="Compute dtype of the compared tensors: fp32, bf16, fp16.")
    max_abs: float | None = Field(None, description="Largest absolute error (None when skipped).")
    relative: float | None = Field(None, description="max_abs / max |reference| (None when skipped).")
    tolerance: float | None = Field(None, description="Largest relative error that passes; 0 means bitwise.")
    verdict: Verdict
    reason: str = Field("", description="Why a row was skipped or failed.")
    seconds: float = Field(0.0, description="Wall time spent on this row.")

    @property
    def ran(self) -> bool:
        return self.verdict != "skip"


def verdict_of(max_abs: float, relative: float, tolerance: float, mismatches: Sequence[str] = ()) -> tuple[Verdict, str]:
    """pass/fail and, for a fail, why (NaN and mismatches fail whatever the tolerance)."""
    if mismatches:
        return "fail", "; ".join(mismatches)
    if math.isnan(max_abs) or math.isnan(relative):
        return "fail", "the result holds NaN"
    if relative <= tolerance:
        return "pass", ""
    limit = "bitwise equality" if tolerance == 0 else f"tolerance {tolerance:g}"
    return "fail", f"relative error {relative:.3g} exceeds {limit}"


def combine(check: str, count: int, backend: str, dtype: str, per_rank: Sequence[Sequence[Measure]]) -> list[CheckRow]:
    """Rows from every rank's measures (same variants, same order on every rank): per variant the
    largest error and reference anywhere, the slowest rank's time, every rank's mismatches."""
    return [row_of(check, count, backend, dtype, across_ranks(measures)) for measures in zip(*per_rank)]


def across_ranks(measures: Sequence[Measure]) -> Measure:
    """One variant's measures from ranks 0, 1, ... as one; worst case and mismatches name their rank."""
    named = [
        m.model_copy(update={"worst": f"rank {rank}" + (f", {m.worst}" if m.worst else ""), "mismatches": [f"rank {rank}: {x}" for x in m.mismatches]})
        for rank, m in enumerate(measures)
    ]
    total = named[0] if len(named) > 1 else measures[0]
    for other in named[1:]:
        total = total.merged(other).model_copy(update={"seconds": max(total.seconds, other.seconds)})
    return total


def row_of(check: str, count: int, backend: str, dtype: str, m: Measure) -> CheckRow:
    relative = m.max_abs / m.scale if m.scale else m.max_abs
    verdict, reason = verdict_of(m.max_abs, relative, m.tolerance, m.mismatches)
    if verdict == "fail" and m.worst and not m.mismatches:
        reason = f"{reason} (worst: {m.worst})"
    return CheckRow(
        check=check, mode=m.variant, count=count, backend=backend, dtype=dtype, max_abs=m.max_abs,
        relative=relative, tolerance=m.tolerance, verdict=verdict, reason=reason, seconds=m.seconds,
    )


def skipped(check: str, mode: str, count: int, dtype: str, reason: str) -> CheckRow:
    return CheckRow(check=check, mode=mode, count=count, backend="none", dtype=dtype, verdict="skip", reason=reason)


class VerifyReport(BaseModel):
    """Everything `h3 verify` ran and measured; written as JSON whether it passed or not."""

    command: str = "verify"
    created: str
    passed: bool = Field(description="True when every row that ran passed (skips do not fail a run).")
    device: str
    device_name: str
    dist_backend: str = Field(description="gloo or nccl (none when only one rank ran).")
    dtype: str
    world_size: int = Field(description="Ranks spawned once and reused by every check and count.")
    counts: list[int] = Field(description="Rank counts asked for.")
    checks: list[str]
    preset: str
    weights: str = "synthetic"
    num_tokens: int = Field(description="Packed sequence length of every check (narrow: divides by none of 2, 4, 6, 8).")
    segments: dict[str, int] = Field(description="Tokens per segment kind of that sequence.")
    steps: int = Field(description="Denoising steps of the end-to-end runs.")
    seed: int
    rows: list[CheckRow]
    spawn_seconds: float = Field(description="Time to start the ranks.")
    seconds: float = Field(description="Wall time of the whole command after argument checks.")
    report_path: str | None = None
    versions: Versions

    @property
    def failed_rows(self) -> list[CheckRow]:
        return [r for r in self.rows if r.verdict == "fail"]

    def failure(self) -> CheckFailed | None:
        """The error to exit with when a check failed (None when all passed), naming the failing rows."""
        failed = self.failed_rows
        if not failed:
            return None
        names = "; ".join(f"{r.check} {r.mode} at {r.count} rank(s): {r.reason}" for r in failed[:6])
        more = f" (and {len(failed) - 6} more)" if len(failed) > 6 else ""
        where = f" (report: {self.report_path})" if self.report_path else ""
        return CheckFailed(f"{len(failed)} verify row(s) failed: {names}{more}{where}")
