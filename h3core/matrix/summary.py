"""The figures of a matrix cell: steady step time, speedup and efficiency against the mode's
1-rank run, the machine's note, and a finished cell's row built from its run report."""

from __future__ import annotations

from statistics import median

from h3core.generate.report import RunReport
from h3core.matrix.cells import PlannedCell
from h3core.matrix.report import CellStatus, MatrixCell
from h3core.runtime import device as dev


def steady_step_seconds(step_seconds: list[float]) -> float | None:
    """Median step time without the first step (one-time warm-up); None without a second step:
    a warm-up step is no step time (it made a 1-step matrix show a 9x speedup on 2 cores)."""
    steady = step_seconds[1:]
    return median(steady) if steady else None


def scaling(baseline_seconds: float | None, seconds: float | None, count: int) -> tuple[float | None, float | None]:
    """(speedup, efficiency) of a cell vs the 1-rank baseline; (None, None) without both times."""
    if not baseline_seconds or not seconds or baseline_seconds <= 0 or seconds <= 0:
        return None, None
    speedup = baseline_seconds / seconds
    return speedup, speedup / count


def ranks_note(device: str, visible_gpus: int) -> str:
    if device == "cuda":
        return f"{visible_gpus} GPU(s) visible: one GPU per rank (NCCL); larger counts are skipped"
    cores = dev.cpu_threads_per_rank(1)
    return f"no GPU used: every count runs as Gloo ranks sharing this machine's {cores} CPU core(s)"


def initial_cell(planned: PlannedCell) -> MatrixCell:
    """A cell's row before it runs: pending, or skipped with the reason."""
    status = CellStatus.SKIPPED if planned.run is None else CellStatus.PENDING
    return MatrixCell(mode=planned.mode, count=planned.count, cfg_parallel=planned.cfg_parallel, requested=planned.requested, status=status, reason=planned.skip)


def summarise(planned: PlannedCell, report: RunReport, threads: int | None, baseline_seconds: float | None, parity_error: str | None) -> MatrixCell:
    """A finished cell's row: its report's figures, scaled against the mode's 1-rank step time."""
    step = steady_step_seconds(report.step_seconds)
    speedup, efficiency = scaling(baseline_seconds, step, planned.count)
    return MatrixCell(
        mode=planned.mode, count=planned.count, cfg_parallel=planned.cfg_parallel, requested=planned.requested, status=CellStatus.OK,
        layout=report.partition.layout.describe(),
        ranks_on=report.ranks_on, threads_per_rank=threads, sampling_seconds=report.timings.get("sampling", 0.0),
        step_seconds=step, speedup=speedup, efficiency=efficiency,
        peak_memory_bytes=max(r.peak_memory_sampling_bytes for r in report.ranks),
        weight_bytes_per_rank=max(r.weights.resident for r in report.ranks),
        comm_bytes=report.comm_total.bytes_sent, parity=report.parity, parity_error=parity_error,
        split=report.profile.steady_mean if report.profile is not None else None,
        report=report.files.report if report.files else None,
    )
