"""Running the matrix: `--repeat` rounds of the cells, interleaved (forward, then backward: a fresh
World each run), one progress bar, the 1-rank results kept for speedups and parity, the report and
files rewritten after every run (see the package docstring for what runs and how the figures are
taken). A cell's first run writes its files and measures its parity; later runs add a step time."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch

from h3core import settings
from h3core.bench.alternate import rounds
from h3core.errors import ConfigError, H3Error
from h3core.generate.files import output_bytes, write_outputs
from h3core.generate.parity import LatentParity, latent_parity, run_tolerance
from h3core.generate.report import StepDone, build_report
from h3core.generate.request import ResolvedRun
from h3core.generate.run import execute, one_rank_latents
from h3core.matrix.cells import PlannedCell, plan_cells
from h3core.matrix.files import write_matrix_files
from h3core.matrix.report import REPORT_NAME, SINGLE_STEP_NOTE, CellStatus, cell_name, MatrixCell, MatrixProgress, MatrixReport, ProgressCallback
from h3core.matrix.request import MatrixRequest
from h3core.matrix.summary import initial_cell, ranks_note, rescale, steady_step_seconds, summarise
from h3core.parallel.modes import Mode
from h3core.reports.outputs import FileInFolder, OutputFile, OutputFolder, Outputs, publish_on_interrupt
from h3core.reports.schema import Versions, timestamp
from h3core.runtime import device as dev

Latents = dict[str, torch.Tensor | None]


class _Bar:
    """Steps done of all planned steps, reported to the caller's one progress bar."""

    def __init__(self, total: int, callback: ProgressCallback | None):
        self.total, self.callback = total, callback
        self.done, self.base, self.label = 0, 0, ""

    def start(self, label: str) -> None:
        self.base, self.label = self.done, label
        self._emit()

    def step(self, message: StepDone) -> None:
        self.done = self.base + message.step
        self._emit()

    def finish(self, steps: int) -> None:
        """A run ended (also by failing): count all its steps as done."""
        self.done = self.base + steps
        self._emit()

    def close(self) -> None:
        self.total = self.done  # references that turned out unneeded (their cells failed)
        self.label = "done"
        self._emit()

    def _emit(self) -> None:
        if self.callback is not None:
            self.callback(MatrixProgress(completed=self.done, total=max(self.total, self.done), label=self.label))


class _Matrix:
    """One matrix run: cells in order, 1-rank results kept for speedups and parity, files rewritten."""

    def __init__(self, request: MatrixRequest, planned: list[PlannedCell], visible_gpus: int, on_progress: ProgressCallback | None,
                 folder: OutputFolder, benchmark: OutputFile | FileInFolder | None):
        self.request, self.planned = request, planned
        self.folder, self.benchmark = folder, benchmark
        self.device = request.template.device
        runnable = [p.run for p in planned if p.run is not None]
        first = runnable[0] if runnable else None
        self.steps = first.shape.steps if first else 0
        self.bar = _Bar(self.steps * (len(runnable) * request.repeat + self._expected_references()), on_progress)
        self.runs: dict[int, list[float]] = {}  # cell index -> the steady step time of each of its runs
        self.baseline_seconds: dict[Mode, float | None] = {}  # the 1-rank cell's step time
        self.references: dict[tuple[Mode, int | None], Latents | str] = {}  # 1-rank latents, or why there are none
        self.report = MatrixReport(
            created=timestamp(),
            request=request,
            device=self.device,
            device_name=dev.device_name(self.device),
            visible_gpus=visible_gpus,
            ranks_note=ranks_note(self.device, visible_gpus),
            dtype=dev.dtype_name(dev.compute_dtype(self.device, request.template.dtype)),
            preset=first.config.name if first else "",
            weights=("synthetic" if first.synthetic else str(first.checkpoint)) if first else "",
            shape=first.shape if first else None,
            peak_memory_kind=dev.peak_memory_kind(self.device),
            cells=[initial_cell(p) for p in planned],
            scaling_note=SINGLE_STEP_NOTE if first and first.shape.steps < 2 else None,
            versions=Versions.collect(),
        )

    def run(self) -> MatrixReport:
        runnable = [index for index, planned in enumerate(self.planned) if planned.run is not None]
        for index in rounds(runnable, self.request.repeat):  # 1-rank cells first in the first round: parity's references
            planned, run = self.planned[index], self.planned[index].run
            assert run is not None
            if index not in self.runs:
                self.runs[index] = []
                self.report.cells[index] = self._run_cell(planned, run)
                self._add_time(index, self.report.cells[index].step_seconds)
            elif self.report.cells[index].status is CellStatus.OK:
                self._run_again(index, planned, run)
            rescale(self.report.cells, self.runs)
            self._write(final=False)
        self.report.identity = self._identity()
        self.report.complete = True
        self.bar.close()
        self._write(final=True)
        return self.report

    # -- one cell -----------------------------------------------------------------------------------

    def _threads(self, count: int) -> int | None:
        """Intra-op threads of each rank of a CPU cell (what launch gives spawned ranks); None on CUDA."""
        return dev.cpu_threads_per_rank(count) if self.device == "cpu" else None

    def _execute(self, planned: PlannedCell, run: ResolvedRun, label: str) -> list[Any]:
        """One run of a cell (a fresh World; one rank runs in this process, at the thread count launch
        gives a lone rank), its steps counted on the bar."""
        threads = self._threads(planned.count)
        self.bar.start(label)
        try:
            with dev.cpu_threads(threads) if threads and planned.count == 1 else nullcontext():
                return execute(run, self.bar.step)
        finally:
            self.bar.finish(self.steps)

    def _add_time(self, index: int, seconds: float | None) -> None:
        if seconds is not None:  # (None: one step, no steady step time)
            self.runs[index].append(seconds)

    def _run_again(self, index: int, planned: PlannedCell, run: ResolvedRun) -> None:
        """A later run of a finished cell: one more step time (a failure fails the cell)."""
        cell = self.report.cells[index]
        label = f"{cell_name(cell)} (run {len(self.runs[index]) + 1} of {self.request.repeat})"
        try:
            outcomes = self._execute(planned, run, label)
        except H3Error as err:
            self.report.cells[index] = cell.model_copy(update={"status": CellStatus.FAILED, "reason": f"{label}: {err}"})
            return
        self._add_time(index, steady_step_seconds(build_report(run, outcomes).step_seconds))

    def _run_cell(self, planned: PlannedCell, run: ResolvedRun) -> MatrixCell:
        mode, count, threads = planned.mode, planned.count, self._threads(planned.count)
        name = cell_name(initial_cell(planned))
        try:
            outcomes = self._execute(planned, run, name)
        except H3Error as err:
            if count == 1:
                self.references[(mode, threads)] = f"the 1-rank cell failed: {err}"
            return initial_cell(planned).model_copy(update={"status": CellStatus.FAILED, "reason": str(err)})
        report = build_report(run, outcomes)
        latents = outcomes[0].latents
        if count == 1:
            self.references[(mode, threads)] = latents
            self.baseline_seconds[mode] = steady_step_seconds(report.step_seconds)
        parity_error = None
        if count > 1:
            report.parity, parity_error = self._parity(run, latents, threads, outcomes[0].nvfp4_paths)
        write_outputs(report, outcomes[0], self.folder, self.request.save_latents, None, under=name.replace("+", "-").replace(" x", "-"))
        return summarise(planned, report, threads, self.baseline_seconds.get(mode), parity_error)

    # -- parity ---------------------------------------------------------------------------------

    def _parity(self, run: ResolvedRun, latents: Latents, threads: int | None, paths: dict[str, int]) -> tuple[LatentParity | None, str | None]:
        mode = run.request.mode
        key = (mode, threads)
        if key not in self.references:
            self.references[key] = self._reference_run(run, threads)
        reference = self.references[key]
        if isinstance(reference, str):
            return None, reference
        tol = run_tolerance(mode, dev.compute_dtype(self.device, run.request.dtype), paths)
        name = f"1 rank, {mode.value} mode" + (f", {threads} CPU thread{'s' if threads > 1 else ''} like each rank" if threads else "")
        return latent_parity(latents, reference, tol, name), None

    def _reference_run(self, run: ResolvedRun, threads: int | None) -> Latents | str:
        """One rank of `run`'s mode in this process, at `threads` intra-op threads (CPU only)."""
        self.bar.start(f"{run.request.mode.value} x1 at {threads} thread(s): parity reference")
        try:
            return one_rank_latents(run, threads=threads, on_step=self.bar.step)
        except H3Error as err:
            return f"the 1-rank reference run failed: {err}"
        finally:
            self.bar.finish(self.steps)

    def _expected_references(self) -> int:
        """Extra 1-rank runs parity will need: CPU thread counts that differ from the 1-rank cell's."""
        if self.device != "cpu":
            return 0
        lone = self._threads(1)
        needed = {(p.mode, self._threads(p.count)) for p in self.planned if p.run is not None and p.count > 1}
        return sum(1 for _, threads in needed if threads != lone)

    def _identity(self) -> LatentParity | None:
        """Ulysses and tensor at one rank are both the identity path: their latents must be equal."""
        if len(self.request.modes) < 2:
            return None
        first, second = (self.references.get((m, self._threads(1))) for m in self.request.modes[:2])
        if not isinstance(first, dict) or not isinstance(second, dict):
            return None
        return latent_parity(second, first, 0.0, f"1 rank, {self.request.modes[0].value} mode")

    def _write(self, final: bool) -> None:
        write_matrix_files(self.report, self.folder, self.benchmark, final)

    def progress(self) -> tuple[int, int]:
        """(cells finished, cells that run): how far an interrupted matrix got."""
        runnable = [c for c in self.report.cells if c.status is not CellStatus.SKIPPED]
        return sum(c.status in (CellStatus.OK, CellStatus.FAILED) for c in runnable), len(runnable)


def run_matrix(request: MatrixRequest, on_progress: ProgressCallback | None = None) -> MatrixReport:
    """Plan every cell (resolving each before anything is spawned), run them, write the report.

    Raises only for what makes the whole matrix impossible (a bad setting, torchrun); a cell's
    failure is recorded in the report; call `check_matrix` to turn failures into an exit code.
    """
    if settings.under_torchrun():
        raise ConfigError("h3 matrix starts its own ranks for every cell; run it directly, not under torchrun")
    gpus = dev.visible_gpu_count()
    planned = plan_cells(request, gpus)
    runs = [p.run for p in planned if p.run is not None]
    need = sum(output_bytes(run, request.save_latents) for run in runs)
    with Outputs() as outputs:
        folder = outputs.folder(request.output, kind="matrix", need_bytes=need, overwrite=request.overwrite)
        bench = outputs.file(request.benchmark, flag="--benchmark") if request.benchmark is not None else None
        matrix = _Matrix(request, planned, gpus, on_progress, folder, bench)
        try:
            report = matrix.run()
        except KeyboardInterrupt as stop:  # Ctrl-C, or SIGTERM (`Terminated`)
            done, total = matrix.progress()
            if not done:
                raise  # nothing measured yet: nothing is written
            publish_on_interrupt(outputs, stop, (
                f" after {done} of {total} cells; what they measured is in {folder.path} "
                f"({REPORT_NAME} says complete: false)"
            ))
        outputs.publish()
    return report
