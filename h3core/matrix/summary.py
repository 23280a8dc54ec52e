"""The figures of a matrix cell: steady step time, speedup and efficiency against the mode's
1-rank run, the machine's note, and a finished cell's row built from its run report."""

from __future__ import annotations

from statistics import median

from h3core.bench.alternate import Spread, beyond_ideal
from h3core.generate.report import RunReport
from h3core.matrix.cells import PlannedCell
from h3core.matrix.report import CellStatus, MatrixCell
from h3core.runtime import device as dev


def rescale(cells: list[MatrixCell], runs: dict[int, list[float]]) -> None:
    """Every finished cell's step time, speedup and efficiency from the step times of all its runs so
    far (`runs`: cell index -> seconds), against its mode's 1-rank cell; flag speedups above the ideal
    by more than their spread (`beyond_ideal`)."""
    baselines = {c.mode: Spread.of(runs[i]) for i, c in enumerate(cells) if c.count == 1 and not c.cfg_parallel and runs.get(i)}
    for index, cell in enumerate(cells):
        if cell.status is not CellStatus.OK or not runs.get(index):
            continue
        spread, baseline = Spread.of(runs[index]), baselines.get(cell.mode)
        speedup = spread.scaled_against(baseline) if baseline is not None else None
        cells[index] = cell.model_copy(update={
            "step_seconds_runs": list(runs[index]), "step_spread": spread, "step_seconds": spread.median, "speedup_spread": speedup,
            "speedup": speedup.median if speedup else None, "efficiency": speedup.median / cell.count if speedup else None,
            "noise": beyond_ideal(speedup, cell.count),
        })


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
