"""The report of `h3 matrix` (matrix.json): one row per mode x count, and what it means."""

from __future__ import annotations

from enum import Enum
from typing import Callable

from pydantic import BaseModel, Field

from h3core.bench.alternate import Spread
from h3core.errors import CheckFailed
from h3core.generate.parity import LatentParity
from h3core.generate.request import RunShape
from h3core.matrix.request import MatrixRequest
from h3core.parallel.modes import Mode
from h3core.reports.schema import Versions

REPORT_NAME, MARKDOWN_NAME, CHART_NAME = "matrix.json", "matrix.md", "matrix.png"

SINGLE_STEP_NOTE = (
    "step time, speedup and efficiency are not shown: with 1 denoising step there is no step after the first, "
    "which carries one-time warm-up; run with --steps 2 or more"
)


class CellStatus(str, Enum):
    OK = "ok"
    FAILED = "failed"
    SKIPPED = "skipped"
    PENDING = "pending"  # only in the report written while the matrix still runs


class MatrixCell(BaseModel):
    """One mode x count of the matrix: what happened and what it measured."""

    mode: Mode
    count: int
    cfg_parallel: bool = Field(False, description="A CFG-parallel cell (--cfg-parallel): two halves of count/2 ranks in `mode`, compared with the mode's 1-rank cell.")
    requested: bool = Field(description="False for a 1-rank baseline that runs although 1 was not asked for.")
    status: CellStatus
    reason: str | None = Field(None, description="Why it was skipped, or the error it failed with.")
    ranks_on: str | None = None
    threads_per_rank: int | None = Field(None, description="CPU: intra-op threads of each rank (None on CUDA).")
    sampling_seconds: float | None = Field(None, description="All denoising steps, slowest rank.")
    step_seconds: float | None = Field(None, description="Median denoising step after the first (slowest rank); the only step when there is one.")
    speedup: float | None = Field(None, description="The mode's 1-rank step time / this cell's (medians over the runs).")
    efficiency: float | None = Field(None, description="speedup / count.")
    step_seconds_runs: list[float] = Field(default_factory=list, description="The step time of each run of the cell (--repeat), in the order they ran.")
    step_spread: Spread | None = Field(None, description="min / median / max of step_seconds_runs.")
    speedup_spread: Spread | None = Field(None, description="The speedup's extremes: slowest baseline / fastest run, median / median, fastest baseline / slowest run.")
    noise: bool = Field(False, description="The speedup is above the ideal (count) by more than its spread: the baseline was slowed (load), it did not scale.")
    peak_memory_bytes: int | None = Field(None, description="Sampling-phase peak of the largest rank.")
    weight_bytes_per_rank: int | None = Field(None, description="Resident weight bytes of the largest rank.")
    comm_bytes: int | None = Field(None, description="Bytes sent through collectives, all ranks together.")
    parity: LatentParity | None = Field(None, description="Latents vs one rank of the same mode (None for the 1-rank cell).")
    parity_error: str | None = Field(None, description="Why parity could not be measured.")
    layout: str | None = Field(None, description="The run's rank layout in words (replicas x CFG halves x ranks per sequence).")
    split: dict[str, float] | None = Field(None, description="With profiling: seconds per step by category (attention, nvfp4_linears, each collective, rest, step), steps after the first, mean over ranks.")
    report: str | None = Field(None, description="The cell's own report.json.")


class MatrixFiles(BaseModel):
    directory: str
    report: str
    markdown: str
    chart: str | None = None
    benchmark: str | None = None


class MatrixReport(BaseModel):
    """Everything `h3 matrix` measured (matrix.json)."""

    command: str = "matrix"
    created: str
    complete: bool = Field(False, description="False while cells are still pending (a report written mid-run).")
    request: MatrixRequest
    device: str
    device_name: str
    visible_gpus: int
    ranks_note: str = Field(description="How counts map to ranks on this machine (GPUs, or Gloo ranks on shared cores).")
    dtype: str
    preset: str
    weights: str
    shape: RunShape | None
    peak_memory_kind: str
    cells: list[MatrixCell]
    identity: LatentParity | None = Field(None, description="The modes' 1-rank cells vs each other (both are the identity path).")
    scaling_note: str | None = Field(None, description="Why step time, speedup and efficiency are not shown, when they are not.")
    files: MatrixFiles | None = None
    versions: Versions

    def cell(self, mode: Mode, count: int, cfg_parallel: bool = False) -> MatrixCell | None:
        return next((c for c in self.cells if c.mode == mode and c.count == count and c.cfg_parallel == cfg_parallel), None)

    def problems(self) -> list[str]:
        """Every failed cell, failed or unmeasured parity, and a 1-rank identity that does not hold."""
        problems = [p for c in self.cells for p in _cell_problems(c)]
        if self.identity is not None and not self.identity.passed:
            problems.append(f"the modes' 1-rank latents differ (max abs {self.identity.max_abs:.3g}); both should be the identity path")
        return problems

    def failure(self) -> CheckFailed | None:
        """The error to exit with, naming every problem (None when there is none)."""
        problems = self.problems()
        if not problems:
            return None
        where = f" (report: {self.files.report})" if self.files else ""
        return CheckFailed(f"{len(problems)} problem(s) in the matrix: {'; '.join(problems)}{where}")


def cell_name(c: "MatrixCell") -> str:
    """'ulysses x4', 'tensor+cfg x8'."""
    return f"{mode_label(c.mode, c.cfg_parallel)} x{c.count}"


def mode_label(mode: Mode, cfg_parallel: bool) -> str:
    """The mode column: 'ulysses', or 'ulysses+cfg' for a CFG-parallel cell."""
    return mode.value + ("+cfg" if cfg_parallel else "")


def _cell_problems(c: MatrixCell) -> list[str]:
    name = cell_name(c)
    if c.status is CellStatus.FAILED:
        return [f"{name} failed: {c.reason}"]
    if c.parity_error:
        return [f"{name} parity not measured: {c.parity_error}"]
    if c.parity is not None and not c.parity.passed:
        return [f"{name} parity {c.parity.relative:.3g} > tolerance {c.parity.tolerance:g}"]
    return []


class MatrixProgress(BaseModel):
    """Progress for the caller's one bar: denoising steps done of all the matrix's steps."""

    completed: int
    total: int
    label: str


ProgressCallback = Callable[[MatrixProgress], None]
