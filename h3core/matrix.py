"""`h3 matrix`: `h3 generate` for every feasible mode x rank count, side by side in one report.

The seed's matrix: Ulysses and tensor mode at 1, 2, 4, 6 and 8 GPUs, counts above the visible
GPU count skipped. What runs, and in which order:

- Per mode, the 1-rank cell runs first, also when 1 is not among the requested counts: it is the
  baseline of every speedup and the parity reference of the mode (marked `requested: false`).
  Then the other counts, ascending. Every cell is a fresh World (`pipeline.execute`).
- Skipped (listed with the reason, never run): on CUDA, counts above the visible GPU count; any
  count whose partition `pipeline.resolve` rejects (e.g. more ranks than heads). On a CPU
  machine every count runs, as Gloo ranks sharing the cores.
- A cell whose run fails (a rank raises or dies) records the error line; the others still run.
  `check_matrix` then raises `CheckFailed`, so the command exits non-zero after its report.
- Each cell writes its own `report.json` (and preview, and latents unless not saved) in
  `<output>/<mode>-<count>/`; `matrix.json` and `matrix.md` are rewritten after every cell,
  `matrix.png` when the matrix is complete. All of it is staged and published as one folder
  (`h3core.outputs`): a matrix interrupted with Ctrl-C publishes the cells it finished (its
  `matrix.json` says `complete: false`); one that fails otherwise leaves nothing.

Figures per cell: sampling time (all steps, slowest rank); step time = the median step after the
first (the first step of a fresh process carries one-time warm-up: lazy kernel and allocator
set-up; the 1-rank cells run in this process, warm after the first of them, so including it
would favour them unevenly); with a single step there is no step after the warm-up: step time,
speedup and efficiency are then not shown, and the report says why (`scaling_note`);
speedup = the mode's 1-rank step time / this cell's; efficiency =
speedup / count; peak memory and resident weight bytes of the
largest rank, bytes sent through collectives by all ranks, and latent parity vs one rank.

CPU honesty: the ranks of a CPU cell share the machine's cores (`cpu_threads_per_rank(count)`
intra-op threads each), so CPU speedups mostly measure how the cores are shared, not scaling.
CPU GEMM and attention kernels choose their blocking by thread count, so two CPU runs are bit
comparable only at equal thread counts: a cell is compared with one rank of the same mode run at
the cell's per-rank thread count. That is the 1-rank cell itself when the counts agree, else an
extra 1-rank reference run in this process (cached per mode and thread count). The parity figure
then isolates the distribution (Ulysses: bitwise; tensor: summation order), not the threading.
On CUDA the reference is always the 1-rank cell.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from statistics import median
from typing import Callable

import torch
from pydantic import BaseModel, ConfigDict, Field

from h3core import device as dev
from h3core import environment as env
from h3core.errors import CheckFailed, ConfigError, H3Error, PartitionError, ResourceLimit
from h3core.outputs import FileInFolder, OutputFile, OutputFolder, Outputs, default_folder, publish_on_interrupt
from h3core.parity import LatentParity, latent_parity, run_tolerance
from h3core.pipeline import GenerateRequest, ResolvedRun, RunReport, RunShape, StepDone, build_report, execute, one_rank_latents, output_bytes, resolve, write_outputs
from h3core.plan import Mode
from h3core.report import Versions, timestamp

DEFAULT_COUNTS = (1, 2, 4, 6, 8)  # the seed's matrix
DEFAULT_MODES = (Mode.ULYSSES, Mode.TENSOR)
REPORT_NAME, MARKDOWN_NAME, CHART_NAME = "matrix.json", "matrix.md", "matrix.png"


# --- settings: flag, else the seed's variable, else the default --------------------------------------


def counts_setting(flag: str | None) -> list[int]:
    """Rank counts, ascending: `--counts`, else H3_GPU_COUNTS, else 1,2,4,6,8."""
    if flag is not None:
        return sorted(env.parse_int_list(flag, "--counts"))
    text = env.env_str(env.GPU_COUNTS)
    if text is not None:
        return sorted(env.parse_int_list(text, env.GPU_COUNTS))
    return list(DEFAULT_COUNTS)


def modes_setting(flag: str | None) -> list[Mode]:
    """Modes in the given order: `--modes`, else H3_DISTRIBUTED_MODES, else ulysses,tensor."""
    source, text = ("--modes", flag) if flag is not None else (env.DISTRIBUTED_MODES, env.env_str(env.DISTRIBUTED_MODES))
    if text is None:
        return list(DEFAULT_MODES)
    known = ", ".join(m.value for m in Mode)
    modes: list[Mode] = []
    for name in env.parse_str_list(text):
        try:
            mode = Mode(name.lower())
        except ValueError:
            raise ConfigError(f"{source} {text!r} names an unknown mode {name!r}; choose from {known}") from None
        if mode not in modes:
            modes.append(mode)
    if not modes:
        raise ConfigError(f"{source} is empty; give e.g. {known}")
    return modes


def save_latents_setting(flag: bool | None) -> bool:
    """`--save-latents/--no-save-latents`, else H3_SAVE_LATENTS (0 = reports only), else save."""
    if flag is not None:
        return flag
    from_env = env.env_bool(env.SAVE_LATENTS)
    return True if from_env is None else from_env


def output_setting(flag: Path | None) -> Path:
    """`--output`, else H3_DISTRIBUTED_OUTPUT, else outputs/<time>-matrix-<4 hex> (a new folder)."""
    if flag is not None:
        return flag
    text = env.env_str(env.OUTPUT)
    return Path(text) if text is not None else default_folder("matrix")


def benchmark_setting(flag: Path | None) -> Path | None:
    """`--benchmark`, else H3_DISTRIBUTED_BENCHMARK, else none: a second copy of the matrix JSON."""
    if flag is not None:
        return flag
    text = env.env_str(env.BENCHMARK)
    return Path(text) if text is not None else None


class MatrixRequest(BaseModel):
    """What `h3 matrix` runs, fully resolved (no environment lookups after `build`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    counts: list[int] = Field(description="Rank counts asked for, ascending; the 1-rank baseline runs even when 1 is not among them.")
    modes: list[Mode] = Field(description="Distributed modes, in the order they run.")
    template: GenerateRequest = Field(description="Settings every cell shares; each cell sets its own mode and world_size.")
    save_latents: bool = Field(description="Write each cell's latents.safetensors (H3_SAVE_LATENTS=0: reports only).")
    output: Path = Field(description="Folder of matrix.json/.md/.png and one subfolder per cell.")
    benchmark: Path | None = Field(None, description="Also write the matrix JSON here (H3_DISTRIBUTED_BENCHMARK).")
    overwrite: bool = Field(False, description="Replace an existing folder of h3 results at `output` whole.")

    @classmethod
    def build(
        cls,
        template: GenerateRequest,
        *,
        counts: str | None = None,
        modes: str | None = None,
        save_latents: bool | None = None,
        output: Path | None = None,
        benchmark: Path | None = None,
        overwrite: bool = False,
    ) -> "MatrixRequest":
        """Apply flag > variable > default to every setting; resolve the template's device."""
        return cls(
            overwrite=overwrite,
            counts=counts_setting(counts),
            modes=modes_setting(modes),
            template=template.model_copy(update={"device": dev.resolve_device(template.device), "world_size": 1}),
            save_latents=save_latents_setting(save_latents),
            output=output_setting(output),
            benchmark=benchmark_setting(benchmark),
        )


# --- the report --------------------------------------------------------------------------------------


class CellStatus(str, Enum):
    OK = "ok"
    FAILED = "failed"
    SKIPPED = "skipped"
    PENDING = "pending"  # only in the report written while the matrix still runs


class MatrixCell(BaseModel):
    """One mode x count of the matrix: what happened and what it measured."""

    mode: Mode
    count: int
    requested: bool = Field(description="False for a 1-rank baseline that runs although 1 was not asked for.")
    status: CellStatus
    reason: str | None = Field(None, description="Why it was skipped, or the error it failed with.")
    ranks_on: str | None = None
    threads_per_rank: int | None = Field(None, description="CPU: intra-op threads of each rank (None on CUDA).")
    sampling_seconds: float | None = Field(None, description="All denoising steps, slowest rank.")
    step_seconds: float | None = Field(None, description="Median denoising step after the first (slowest rank); the only step when there is one.")
    speedup: float | None = Field(None, description="The mode's 1-rank step time / this cell's.")
    efficiency: float | None = Field(None, description="speedup / count.")
    peak_memory_bytes: int | None = Field(None, description="Sampling-phase peak of the largest rank.")
    weight_bytes_per_rank: int | None = Field(None, description="Resident weight bytes of the largest rank.")
    comm_bytes: int | None = Field(None, description="Bytes sent through collectives, all ranks together.")
    parity: LatentParity | None = Field(None, description="Latents vs one rank of the same mode (None for the 1-rank cell).")
    parity_error: str | None = Field(None, description="Why parity could not be measured.")
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

    def cell(self, mode: Mode, count: int) -> MatrixCell | None:
        return next((c for c in self.cells if c.mode is mode and c.count == count), None)


class MatrixProgress(BaseModel):
    """Progress for the caller's one bar: denoising steps done of all the matrix's steps."""

    completed: int
    total: int
    label: str


ProgressCallback = Callable[[MatrixProgress], None]


# --- summary math ----------------------------------------------------------------------------------


SINGLE_STEP_NOTE = (
    "step time, speedup and efficiency are not shown: with 1 denoising step there is no step after the first, "
    "which carries one-time warm-up; run with --steps 2 or more"
)


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


def skip_reason(count: int, device: str, visible_gpus: int) -> str | None:
    """Why a count cannot run on this machine (None: it can). CPU: any count, as Gloo ranks."""
    if device == "cuda" and count > visible_gpus:
        return f"{count} GPUs needed, {visible_gpus} visible"
    return None


def ranks_note(device: str, visible_gpus: int) -> str:
    if device == "cuda":
        return f"{visible_gpus} GPU(s) visible: one GPU per rank (NCCL); larger counts are skipped"
    cores = dev.cpu_threads_per_rank(1)
    return f"no GPU used: every count runs as Gloo ranks sharing this machine's {cores} CPU core(s)"


def check_matrix(report: MatrixReport) -> None:
    """Raise `CheckFailed` naming every failed cell and failed or unmeasured parity."""
    problems = matrix_problems(report)
    if problems:
        where = f" (report: {report.files.report})" if report.files else ""
        raise CheckFailed(f"{len(problems)} problem(s) in the matrix: {'; '.join(problems)}{where}")


def matrix_problems(report: MatrixReport) -> list[str]:
    problems = []
    for c in report.cells:
        name = f"{c.mode.value} x{c.count}"
        if c.status is CellStatus.FAILED:
            problems.append(f"{name} failed: {c.reason}")
        elif c.parity_error:
            problems.append(f"{name} parity not measured: {c.parity_error}")
        elif c.parity is not None and not c.parity.passed:
            problems.append(f"{name} parity {c.parity.relative:.3g} > tolerance {c.parity.tolerance:g}")
    if report.identity is not None and not report.identity.passed:
        problems.append(f"the modes' 1-rank latents differ (max abs {report.identity.max_abs:.3g}); both should be the identity path")
    return problems


# --- planning ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PlannedCell:
    """A cell before it runs: its resolved run, or why it is skipped."""

    mode: Mode
    count: int
    requested: bool
    run: ResolvedRun | None
    skip: str | None


def plan_cells(request: MatrixRequest, visible_gpus: int) -> list[PlannedCell]:
    """Per mode: the 1-rank cell, then the other counts ascending. A 1-rank cell that cannot be
    resolved is a user error for the whole matrix (raised); other counts the partition rejects are skipped."""
    return [_plan_cell(request, mode, count, visible_gpus) for mode in request.modes for count in sorted({1, *request.counts})]


def _plan_cell(request: MatrixRequest, mode: Mode, count: int, visible_gpus: int) -> PlannedCell:
    requested = count in request.counts
    reason = skip_reason(count, request.template.device, visible_gpus)
    if reason is not None:
        return PlannedCell(mode, count, requested, None, reason)
    try:
        run = resolve(request.template.model_copy(update={"mode": mode, "world_size": count}))
    except (PartitionError, ResourceLimit) as err:
        if count == 1:
            raise
        return PlannedCell(mode, count, requested, None, str(err))
    return PlannedCell(mode, count, requested, run, None)


# --- running ---------------------------------------------------------------------------------------


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
        self.bar = _Bar(self.steps * (len(runnable) + self._expected_references()), on_progress)
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
            cells=[_initial_cell(p) for p in planned],
            scaling_note=SINGLE_STEP_NOTE if first and first.shape.steps < 2 else None,
            versions=Versions.collect(),
        )

    def run(self) -> MatrixReport:
        for index, planned in enumerate(self.planned):
            if planned.run is not None:
                self.report.cells[index] = self._run_cell(planned, planned.run)
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

    def _run_cell(self, planned: PlannedCell, run: ResolvedRun) -> MatrixCell:
        mode, count, threads = planned.mode, planned.count, self._threads(planned.count)
        self.bar.start(f"{mode.value} x{count}")
        try:
            # One rank runs in this process: give it the thread count launch gives a lone rank.
            with dev.cpu_threads(threads) if threads and count == 1 else nullcontext():
                outcomes = execute(run, self.bar.step)
        except H3Error as err:
            if count == 1:
                self.references[(mode, threads)] = f"the 1-rank cell failed: {err}"
            return _initial_cell(planned).model_copy(update={"status": CellStatus.FAILED, "reason": str(err)})
        finally:
            self.bar.finish(self.steps)
        report = build_report(run, outcomes)
        latents = outcomes[0].latents
        if count == 1:
            self.references[(mode, threads)] = latents
            self.baseline_seconds[mode] = steady_step_seconds(report.step_seconds)
        parity_error = None
        if count > 1:
            report.parity, parity_error = self._parity(run, latents, threads, outcomes[0].nvfp4_paths)
        write_outputs(report, outcomes[0], self.folder, self.request.save_latents, None, under=f"{mode.value}-{count}")
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

    # -- files -----------------------------------------------------------------------------------

    def _write(self, final: bool) -> None:
        """Stage matrix.json and matrix.md (after every cell); matrix.png and the benchmark copy at the end."""
        from h3core.matrix_render import chart_png, markdown

        out = self.folder.path
        files = MatrixFiles(directory=str(out), report=str(out / REPORT_NAME), markdown=str(out / MARKDOWN_NAME))
        if final:
            files.chart = str(self.folder.write(CHART_NAME, chart_png(self.report)))
            files.benchmark = str(self.benchmark.path) if self.benchmark else None
        self.report.files = files
        self.folder.write(MARKDOWN_NAME, markdown(self.report).encode())
        data = (self.report.model_dump_json(indent=2) + "\n").encode()
        if final and self.benchmark is not None:
            self.benchmark.write(data)
        self.folder.write(REPORT_NAME, data)

    def progress(self) -> tuple[int, int]:
        """(cells finished, cells that run): how far an interrupted matrix got."""
        runnable = [c for c in self.report.cells if c.status is not CellStatus.SKIPPED]
        return sum(c.status in (CellStatus.OK, CellStatus.FAILED) for c in runnable), len(runnable)


def _initial_cell(planned: PlannedCell) -> MatrixCell:
    status = CellStatus.SKIPPED if planned.run is None else CellStatus.PENDING
    return MatrixCell(mode=planned.mode, count=planned.count, requested=planned.requested, status=status, reason=planned.skip)


def summarise(planned: PlannedCell, report: RunReport, threads: int | None, baseline_seconds: float | None, parity_error: str | None) -> MatrixCell:
    """A finished cell's row: its report's figures, scaled against the mode's 1-rank step time."""
    step = steady_step_seconds(report.step_seconds)
    speedup, efficiency = scaling(baseline_seconds, step, planned.count)
    return MatrixCell(
        mode=planned.mode,
        count=planned.count,
        requested=planned.requested,
        status=CellStatus.OK,
        ranks_on=report.ranks_on,
        threads_per_rank=threads,
        sampling_seconds=report.timings.get("sampling", 0.0),
        step_seconds=step,
        speedup=speedup,
        efficiency=efficiency,
        peak_memory_bytes=max(r.peak_memory_sampling_bytes for r in report.ranks),
        weight_bytes_per_rank=max(r.weights.resident for r in report.ranks),
        comm_bytes=report.comm_total.bytes_sent,
        parity=report.parity,
        parity_error=parity_error,
        split=report.profile.steady_mean if report.profile is not None else None,
        report=report.files.report if report.files else None,
    )


def run_matrix(request: MatrixRequest, on_progress: ProgressCallback | None = None) -> MatrixReport:
    """Plan every cell (resolving each before anything is spawned), run them, write the report.

    Raises only for what makes the whole matrix impossible (a bad setting, torchrun); a cell's
    failure is recorded in the report; call `check_matrix` to turn failures into an exit code.
    """
    from h3core.launch import under_torchrun

    if under_torchrun():
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
        except KeyboardInterrupt:
            done, total = matrix.progress()
            if not done:
                raise  # nothing measured yet: nothing is written
            publish_on_interrupt(outputs, (
                f"interrupted (Ctrl-C) after {done} of {total} cells; what they measured is in {folder.path} "
                f"({REPORT_NAME} says complete: false)"
            ))
        outputs.publish()
    return report
