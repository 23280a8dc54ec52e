"""The dry run: h3's own rank code at a run's real shapes on fake tensors, and the memory it would take.

`dry_run(run, arch)` executes, for every rank of `run`'s layout (ranks whose local shapes are all
the same are run once), exactly what a rank runs: `RankPipeline.load` (the checkpoint's loader and
`parallelize`: tensor mode reads its shards) and `RankPipeline.denoise` (the sequences, the refined
text, the noise, the denoising loop with its collectives, the final gather), on fake tensors
(`FakeTensorMode`) with a fake process group, and counts every device storage alive at each moment
(`h3core.runtime.fake_cuda.StorageTracker`). Nothing is read from the checkpoint: its header (or
the synthetic layout's specs) gives every tensor's name, shape and dtype, and each read hands back a
fake tensor of that shape (`HeaderReader`); the Comfy markers, which decide the layout, are what
the file's header-side parse found (`open_transformer`) or the synthetic layout's own.

`arch` is the GPU the run is predicted for (`ARCHS`): `sm_90` (Hopper: the NVFP4 linears take
`cuda-dequant-bf16`) or `sm_120` (Blackwell: `cuda-fp4-scaled-mm`, with the fused Triton
quantizer's allocations and the fp4 self-test taken as passed). `torch.cuda` answers as that GPU
(`simulated_cuda`); a CPU-only torch needs the no-op CUDA device guard (`cuda_guard_problem`). With
`arch="cpu"` the same code runs on fake CPU tensors (how the tests compare a prediction with a real
CPU run).

What comes back per rank (`RankPrediction`): the device peak while loading, the peak of the
sampling phase (the window `torch.cuda.max_memory_allocated` covers in a run's report:
`peak_memory_sampling_bytes`), the live bytes after each step (equal from step to step, or something
grows), the host syncs the CUDA path makes (a value read or a copy to the host, with the h3 line:
`check_finite`'s one per step is by design), and the NVFP4 paths and attention kernels it took. A
shape or dtype error anywhere in that code fails the dry run with the error and where it happened.
It runs `steps` forwards (default 2, the first and a steady one), not the run's 49: the peak of a
step does not depend on which step it is.

`predicted_peaks(run, arch)` is the figure the memory check before a CUDA run uses
(`h3core.generate.memory.check_predicted`): per rank, the peak over its whole life.
"""

from __future__ import annotations

import time
import weakref
from contextlib import ExitStack, contextmanager
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Sequence
from unittest import mock

import torch
from pydantic import BaseModel, ConfigDict, Field

from h3core.checkpoints.file import TransformerFile, _classify, open_transformer
from h3core.files.safetensors import SafetensorsReader, _Entry
from h3core.generate.report import HeldWeights
from h3core.generate.request import ResolvedRun
from h3core.model.checkpoint import SYNTHETIC, WEIGHTS_KEY, Checkpoint, TensorSpec
from h3core.model.sequence import SegmentKind
from h3core.nvfp4 import comfy
from h3core.nvfp4.matmul import PATH_CUDA_BF16, PATH_CUDA_FP4
from h3core.parallel.plan import Mode, ParallelPlan
from h3core.runtime import fake_cuda
from h3core.runtime.context import RankContext

if TYPE_CHECKING:
    from torch._subclasses.fake_tensor import FakeTensorMode

DEFAULT_STEPS = 3
"""Sigma points of a dry run: two forwards, the first and a steady one."""


class Arch(BaseModel):
    """A GPU architecture a dry run predicts for."""

    model_config = ConfigDict(frozen=True)
    name: str
    capability: tuple[int, int]
    nvfp4_path: str = Field(description="The path h3's NVFP4 linears take there (h3core.nvfp4.matmul).")
    example: str
    total_memory: int = Field(description="Bytes of the example GPU (what torch.cuda reports for it).")


ARCHS: dict[str, Arch] = {
    "sm_90": Arch(name="sm_90", capability=(9, 0), nvfp4_path=PATH_CUDA_BF16, example="NVIDIA H100 / H200 (Hopper)", total_memory=150_096_625_664),
    "sm_120": Arch(name="sm_120", capability=(12, 0), nvfp4_path=PATH_CUDA_FP4, example="NVIDIA RTX PRO 6000 Blackwell", total_memory=101_974_556_672),
}
"""The two GPU paths h3 has: Hopper's weight-only dequant, Blackwell's fp4 x fp4 GEMM."""


class HostSyncCount(BaseModel):
    """A host sync the CUDA path made, where, and how often (per rank, over the simulated steps)."""

    what: str = Field(description="'item' (a device value read on the host) or 'copy to host'.")
    op: str
    where: str = Field(description="The innermost h3 source line that asked.")
    phase: str = Field(description="'load' or 'sampling'.")
    count: int


class RankPrediction(BaseModel):
    """What one rank would hold on its device, from the dry run of its own code."""

    rank: int = Field(description="Global rank.")
    same_as: list[int] = Field(default_factory=list, description="Other ranks with the same local shapes (run once, same figures).")
    peak_load: int = Field(description="Device peak while loading and parallelizing (bytes).")
    peak_sampling: int = Field(description="Device peak of the sampling phase: what a report's peak_memory_sampling_bytes measures.")
    peak_total: int = Field(description="Device peak over the rank's whole life (load, the sequences and refined text, sampling).")
    resident_after_load: int = Field(description="Device bytes alive once the model is loaded (weights and what load keeps).")
    live_after_steps: list[int] = Field(description="Device bytes alive after each simulated step.")
    weights: HeldWeights
    host_syncs: list[HostSyncCount] = Field(default_factory=list)
    nvfp4_paths: dict[str, int] = Field(default_factory=dict)
    attention_kernels: dict[str, int] = Field(default_factory=dict)
    fp4_gemm_shapes: list[list[int]] = Field(default_factory=list, description="Every distinct fp4 GEMM [M, N, K] the rank's code called (padded): what the fp4 self-test before a run checks.")

    @property
    def peak(self) -> int:
        return self.peak_total


class DryRun(BaseModel):
    """A dry run of one run on one architecture: every rank's prediction."""

    arch: str
    device: str
    mode: str
    world_size: int
    preset: str
    steps_simulated: int
    ranks: list[RankPrediction]
    seconds: float

    def gemm_shapes(self) -> list[list[int]]:
        """Every distinct fp4 GEMM [M, N, K] any rank called (ranks with the same shapes ran once)."""
        return [list(s) for s in sorted({tuple(s) for r in self.ranks for s in r.fp4_gemm_shapes})]

    def peaks(self) -> list[int]:
        """Per global rank (every rank of the layout), its peak over load and sampling."""
        by_rank = {r.rank: r.peak for r in self.ranks}
        by_rank.update({other: r.peak for r in self.ranks for other in r.same_as})
        return [by_rank[i] for i in range(self.world_size)]


def arch_of(capability: tuple[int, int]) -> str | None:
    """The architecture whose path a GPU of `capability` takes (fp4 from 10.0 on, else the dequant path)."""
    from h3core.nvfp4.matmul import FP4_MIN_CAPABILITY

    return "sm_120" if tuple(capability) >= FP4_MIN_CAPABILITY else "sm_90"


def dry_run_problem(arch: str) -> str | None:
    """None when a dry run for `arch` can run in this process, else why not (one line)."""
    if arch == "cpu":
        return None
    if arch not in ARCHS:
        return f"unknown architecture {arch!r}; choose one of: {', '.join(ARCHS)}, cpu"
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return "this process is a rank of a process group (torchrun): a dry run simulates ranks in a process without one"
    return fake_cuda.cuda_guard_problem()


def predicted_peaks(run: ResolvedRun, arch: str) -> list[int]:
    """Per rank of `run`, the device peak its own code would reach on `arch` (its whole life: load, sequences, sampling)."""
    return dry_run(run, arch).peaks()


def dry_run(run: ResolvedRun, arch: str, steps: int = DEFAULT_STEPS) -> DryRun:
    """Run every distinct rank of `run` on fake tensors for `arch` (module docstring)."""
    problem = dry_run_problem(arch)
    if problem is not None:
        raise RuntimeError(f"no dry run here: {problem}")
    started = time.perf_counter()
    short = run.model_copy(update={"shape": run.shape.model_copy(update={"steps": min(steps, run.shape.steps)})})
    groups = _distinct_ranks(run)
    ranks = []
    for rank, same in groups.items():
        prediction = _rank_dry_run(short, arch, rank)
        ranks.append(prediction.model_copy(update={"same_as": same}))
    return DryRun(arch=arch, device="cpu" if arch == "cpu" else "cuda", mode=run.plan.mode.value, world_size=run.plan.layout.world_size,
                  preset=run.config.name, steps_simulated=short.shape.steps, ranks=ranks, seconds=time.perf_counter() - started)


def _distinct_ranks(run: ResolvedRun) -> dict[int, list[int]]:
    """The layout's ranks of the first replica grouped by what shapes their code sees: {first: others}
    (a rank's shapes follow from its branch, its plan entry and whether it is rank 0; the other
    replicas are copies of the first)."""
    layout, plan = run.plan.layout, run.plan
    first: dict[tuple, int] = {}
    groups: dict[int, list[int]] = {}
    for rank in range(layout.world_size):
        c = layout.coords(rank)
        mine = plan.ranks[c.local]
        key = (c.branch, rank == 0, len(mine.heads),
               tuple(tuple((s.kind, len(s)) for s in _clipped(seq, c.local)) for seq in plan.sequences),
               mine.tensor.model_dump_json(exclude={"qkv_rows", "fc1_rows"}) if mine.tensor else None,
               tuple(sum(len(s) for s in part) for part in (mine.tensor.qkv_rows, mine.tensor.fc1_rows)) if mine.tensor else None)
        if key in first:
            groups[first[key]].append(rank)
        else:
            first[key] = rank
            groups[rank] = []
    return groups


def _clipped(sequence, local: int):  # type: ignore[no-untyped-def]
    from h3core.parallel import partition

    return partition.clip_segments(sequence.segments, sequence.tokens[local])


# --- one rank ---------------------------------------------------------------------------------------


def _rank_dry_run(run: ResolvedRun, arch: str, rank: int, fake: bool = True) -> RankPrediction:
    """One rank's load and denoise under the tracker: on fake tensors (the dry run), or with `fake=False`
    on real CPU tensors from the real checkpoint (the measurement a CPU prediction is compared with)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from h3core.generate.pipeline import RankPipeline, new_record, rank_runtime
    from h3core.parallel import collectives

    device = torch.device("cpu") if arch == "cpu" else torch.device("cuda", 0)
    kind = device.type
    tracker = fake_cuda.StorageTracker()
    world = run.plan.layout.world_size
    file = header_only_file(run) if fake else None  # before the fake mode: the markers detection reads are real bytes
    collectives.release_scratch()  # the CPU collectives' kept buffer belongs to this rank's run, counted in it
    with ExitStack() as stack:
        stack.callback(collectives.release_scratch)
        stack.enter_context(_own_caches())
        group = stack.enter_context(fake_cuda.fake_world(rank, world))
        stack.enter_context(_device_answers(arch, tracker))
        if fake:
            mode = stack.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
            stack.enter_context(tracker)
            stack.enter_context(_header_only_checkpoint(file, run))  # type: ignore[arg-type]
            stack.enter_context(_real_on_host(mode))
        else:
            stack.enter_context(tracker)
        ctx = RankContext(rank, world, rank, device, group, "fake" if group is not None else "none")
        runtime = rank_runtime(ctx, run)
        pipeline = RankPipeline.load(ctx, run, runtime)
        peak_load, resident = tracker.peak(kind), tracker.live(kind)
        tracker.phase = "sampling"
        live_after: list[int] = []
        texts = _text_states(run, rank, device)
        with _live_after_each_step(tracker, kind, live_after), _sampling_window(tracker, kind):
            done = pipeline.denoise(run, texts, new_record(ctx))
        peak_sampling, peak_total = tracker.peak(kind), tracker.highest(kind)
        paths, kernels, shapes = runtime.record.paths(), runtime.record.kernels(), runtime.record.gemm_shapes()
        weights = pipeline.weights
        del pipeline, done, texts
    return RankPrediction(
        rank=rank, peak_load=peak_load, peak_sampling=peak_sampling, peak_total=peak_total, resident_after_load=resident,
        live_after_steps=live_after, weights=weights, host_syncs=_counted(tracker.syncs), nvfp4_paths=paths, attention_kernels=kernels,
        fp4_gemm_shapes=shapes,
    )


def measured_cpu_run(run: ResolvedRun, rank: int = 0, steps: int = DEFAULT_STEPS) -> RankPrediction:
    """The same rank code on real CPU tensors from `run`'s real checkpoint, its live storage counted the
    same way: what `dry_run(run, "cpu")` predicts, measured (tests compare the two)."""
    short = run.model_copy(update={"shape": run.shape.model_copy(update={"steps": min(steps, run.shape.steps)})})
    return _rank_dry_run(short, "cpu", rank, fake=False)


def _text_states(run: ResolvedRun, rank: int, device: torch.device) -> list[torch.Tensor]:
    """The text encoder's output for each sequence, as rank 0's broadcast hands it to every rank (float32
    `[L, text_dim]`; on the rank's device when it travelled, on the host at one rank)."""
    where = device if run.plan.layout.world_size > 1 else torch.device("cpu")
    lengths = [sum(len(s) for s in seq.segments if s.kind is SegmentKind.TEXT) for seq in run.plan.sequences]
    return [torch.randn(n, run.config.text_dim, dtype=torch.float32, device=where) for n in lengths]


@contextmanager
def _own_caches() -> Iterator[None]:
    """The process's module-level caches and records, emptied for the dry run and given back after it:
    tables cached per device (a fake tensor left there would be read as data by a later real run), the
    SDPA and fp4 verdicts decided for the simulated GPU, and the records of what ran."""
    from h3core.model import attention
    from h3core.nvfp4 import codec, selftest

    caches = [codec._pair_tables, codec._e4m3_tables, attention._sdpa_choices, attention._choices, selftest._kernel_problems]
    saved = [dict(c) for c in caches]
    for c in caches:
        c.clear()
    try:
        yield
    finally:
        for c, kept in zip(caches, saved):
            c.clear()
            c.update(kept)


@contextmanager
def _real_on_host(fake: "FakeTensorMode") -> Iterator[None]:
    """Host arithmetic whose values decide shapes runs on real host tensors (outside the fake mode), as
    the rank computes it: the packed sequence's position ids (the RoPE table's rows), the sigma
    schedules (`unique_consecutive`, kept real on the schedule) and each step's distinct timesteps
    (`Denoiser.clocks`: `unique`, computed on the host, then moved); the tensors they return are
    handed on as fake tensors (`fake.from_tensor`), as everything else is."""
    from h3core.generate import sequences
    from h3core.generate.loop import Denoiser
    from h3core.model.sampler import FlowMatchH3

    real_positions, real_clocks = _outside_fake(sequences.position_ids), _outside_fake(Denoiser.clocks)

    def positions(*args, **kwargs):  # type: ignore[no-untyped-def]
        return fake.from_tensor(real_positions(*args, **kwargs))

    def clocks(self, index, device):  # type: ignore[no-untyped-def]
        host = real_clocks(self, index, torch.device("cpu"))
        return replace(host, values=fake.from_tensor(host.values)).to(device)

    with mock.patch.object(sequences, "position_ids", positions), mock.patch.object(Denoiser, "clocks", clocks), \
            mock.patch.object(FlowMatchH3, "set_timesteps", _outside_fake(FlowMatchH3.set_timesteps)):
        yield


def _outside_fake(fn):  # type: ignore[no-untyped-def]
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    def real(*args, **kwargs):  # type: ignore[no-untyped-def]
        with unset_fake_temporarily():
            return fn(*args, **kwargs)

    return real


@contextmanager
def _sampling_window(tracker: fake_cuda.StorageTracker, kind: str) -> Iterator[None]:
    """The tracker's peak window starts where the pipeline starts its own (`_start_sampling_window`, before
    the loop): on CUDA that is the same reset, on the CPU the pipeline's is the process's RSS."""
    from h3core.generate import pipeline

    real = pipeline._start_sampling_window

    def reset(device):  # type: ignore[no-untyped-def]
        real(device)
        tracker.reset_peak(kind)

    with mock.patch.object(pipeline, "_start_sampling_window", reset):
        yield


@contextmanager
def _live_after_each_step(tracker: fake_cuda.StorageTracker, kind: str, record: list[int]) -> Iterator[None]:
    """Record the live device bytes after every denoising step (the loop's `check_finite` runs once per step)."""
    from h3core.generate import loop

    real = loop.check_finite

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        real(*args, **kwargs)
        record.append(tracker.live(kind))

    with mock.patch.object(loop, "check_finite", counted):
        yield


def _counted(syncs: Sequence[fake_cuda.HostSync]) -> list[HostSyncCount]:
    counts: dict[fake_cuda.HostSync, int] = {}
    for sync in syncs:
        counts[sync] = counts.get(sync, 0) + 1
    return [HostSyncCount(what=s.what, op=s.op, where=s.where, phase=s.phase, count=n) for s, n in counts.items()]


@contextmanager
def _device_answers(arch: str, tracker: fake_cuda.StorageTracker) -> Iterator[None]:
    """On a simulated GPU: torch.cuda as that GPU, the fp4 self-test passed (sm_120), the fused
    quantizer's allocations made and its launch skipped (fake tensors have no data to quantize)."""
    if arch == "cpu":
        yield
        return
    from h3core.nvfp4 import activation, linear

    spec = ARCHS[arch]
    with ExitStack() as stack:
        stack.enter_context(fake_cuda.simulated_cuda(spec.capability, tracker, spec.total_memory, spec.example))
        stack.enter_context(mock.patch.object(linear, "fp4_kernel_problem", lambda device: None))
        stack.enter_context(mock.patch.object(activation, "triton_available", lambda: True))
        stack.enter_context(mock.patch.object(activation, "_kernel", lambda: _NoLaunch()))
        yield


class _NoLaunch:
    """A Triton kernel's `kernel[grid](...)` that launches nothing (its outputs are allocated by the caller)."""

    def __getitem__(self, grid: object) -> "_NoLaunch":
        return self

    def __call__(self, *args: object, **kwargs: object) -> None:
        return None


# --- the checkpoint, header only -------------------------------------------------------------------------


class HeaderReader(SafetensorsReader):
    """A `SafetensorsReader` over a checkpoint's header: the same names, shapes and dtypes, and every read
    hands back an uninitialised tensor of the slice's shape (a fake one under FakeTensorMode), counted
    in `bytes_read` as the real read would be; no byte is read. `values`: small tensors returned as
    they are (the Comfy markers of a synthetic layout, which detection reads)."""

    def __init__(self, entries: dict[str, tuple[str, tuple[int, ...]]], metadata: dict[str, str], paths: Sequence[Path],
                 values: dict[str, torch.Tensor] | None = None):
        self.paths = [Path(p) for p in paths]
        self.bytes_read = 0
        self._entries = {name: _Entry(self.paths[0], -1, dtype, shape, 0) for name, (dtype, shape) in entries.items()}
        self._metadata = dict(metadata)
        self._fds: list[int] = []
        self._finalizer = weakref.finalize(self, lambda: None)
        self._values = values or {}

    @classmethod
    def of_reader(cls, reader: SafetensorsReader) -> "HeaderReader":
        return cls({n: (e.dtype, e.shape) for n, e in reader._entries.items()}, reader.metadata, reader.paths)

    @classmethod
    def of_specs(cls, specs: Sequence[TensorSpec], metadata: dict[str, str], path: Path, values: dict[str, torch.Tensor]) -> "HeaderReader":
        return cls({s.name: (s.dtype, s.shape) for s in specs}, metadata, [path], values)

    def _empty(self, name: str, shape: Sequence[int]) -> torch.Tensor:
        out = torch.empty(tuple(shape), dtype=self.dtype(name))
        self.bytes_read += out.numel() * out.element_size()
        return out

    def get(self, name: str) -> torch.Tensor:
        if name in self._values:
            return self._values[name]  # real bytes (read with .tolist(), which no fake mode sees)
        return self._empty(name, self._entry(name).shape)

    def get_rows(self, name: str, rows):  # type: ignore[no-untyped-def]
        shape = self._entry(name).shape
        for span in rows:
            self._check_span(name, span, shape[0], "rows")
        return self._empty(name, (sum(s.stop - s.start for s in rows), *shape[1:]))

    def get_columns(self, name: str, cols):  # type: ignore[no-untyped-def]
        shape = self._entry(name).shape
        self._check_span(name, cols, shape[-1], "columns")
        return self._empty(name, (*shape[:-1], cols.stop - cols.start))

    def get_bytes(self, name: str, ranges):  # type: ignore[no-untyped-def]
        self._entry(name)
        return self._empty_bytes(sum(s.stop - s.start for s in ranges))

    def _empty_bytes(self, n: int) -> torch.Tensor:
        self.bytes_read += n
        return torch.empty(n, dtype=torch.uint8)


def header_only_file(run: ResolvedRun) -> TransformerFile:
    """`run`'s checkpoint with a `HeaderReader`: the file's own header where the file exists, else the
    synthetic layout of `run.config` (what `h3 plan --memory` predicts for without building it)."""
    path = Path(run.checkpoint)
    if path.exists():
        file = open_transformer(path)
        real, file.reader = file.reader, HeaderReader.of_reader(file.reader)
        real.close()
        return file
    if not run.synthetic:
        raise RuntimeError(f"no checkpoint at {path} to read a header from")
    from h3core.model.synthetic import _NVFP4_MARKER, synthetic_specs

    specs = synthetic_specs(run.config)
    marker = comfy.marker_tensor(_NVFP4_MARKER)
    values = {s.name: marker for s in specs if s.name.endswith(f".{comfy.MARKER}")}
    reader = HeaderReader.of_specs(specs, {WEIGHTS_KEY: SYNTHETIC}, path, values)
    return _classify(path, reader, folder=False)


@contextmanager
def _header_only_checkpoint(file: TransformerFile, run: ResolvedRun) -> Iterator[None]:
    """`Checkpoint.open` (what `RankPipeline.load` calls) opens `file`, `run`'s checkpoint header-only."""

    def opened(cls, path, base):  # type: ignore[no-untyped-def]
        return Checkpoint(file, run.config)

    with mock.patch.object(Checkpoint, "open", classmethod(opened)):
        yield


# --- the memory check before a CUDA run ----------------------------------------------------------------


def check_predicted(run: ResolvedRun) -> DryRun | None:
    """On a CUDA run, refuse (one line) a run whose dry run predicts a peak above a GPU's usable memory;
    returns the dry run (its peaks, and the fp4 GEMM shapes the self-test then checks), or None where no
    dry run can run here (not CUDA, H3_MEMORY_CHECK=0, no guard): the formula's check
    (`h3core.generate.memory.check_limits`, a lower bound, run first in `resolve`) is then the only one."""
    from h3core import settings
    from h3core.errors import ResourceLimit
    from h3core.reports.units import format_bytes
    from h3core.runtime.limits import capacity

    if run.request.device != "cuda" or not settings.memory_check() or not torch.cuda.is_available():
        return None
    arch = arch_of(torch.cuda.get_device_capability(0))
    if dry_run_problem(arch) is not None:
        return None
    try:
        dry = dry_run(run, arch)
        peaks = dry.peaks()
    except Exception:  # noqa: BLE001 - a dry run that cannot finish is no prediction: the formula's check stands
        if settings.debug():
            raise
        return None
    usable = min(capacity("cuda", settings.ranks_on_this_machine(len(peaks))).gpu_bytes or [0])
    if usable and max(peaks) > usable:
        worst = max(range(len(peaks)), key=peaks.__getitem__)
        raise ResourceLimit(
            f"the dry run of this run's own code predicts a peak of {format_bytes(max(peaks))} of GPU memory on rank {worst}, but a GPU "
            f"here has {format_bytes(usable)} usable; use tensor mode, more GPUs or a smaller --width/--height/--frames "
            f"(h3 plan --memory shows each rank's peak); {settings.MEMORY_CHECK}=0 skips this check"
        )
    return dry


# --- h3 plan --memory ------------------------------------------------------------------------------------


class PlanMemory(BaseModel):
    """`h3 plan --memory`: the plan (with the decoded-weights choice of the first architecture) and, per
    architecture, the dry run of every rank."""

    plan: ParallelPlan
    dry_runs: list[DryRun]
    skipped: str | None = Field(None, description="Why no dry run ran here (then `dry_runs` is empty).")
    adapters: list = Field(default_factory=list, description="The LoRA adapters counted (`AdapterRecord`: bytes per rank on the plan).")


def plan_memory(preset_name: str, count: int | None, mode: Mode, *, archs: Sequence[str] = tuple(ARCHS), width: int | None = None,
                height: int | None = None, frames: int | None = None, text_tokens: int | None = None, cfg_parallel: bool = False,
                replicas: int = 1, decoded_weights: str = "auto", loras: Sequence = ()) -> PlanMemory:
    """The dry run of preset `preset_name`'s synthetic layout (the seed's file, tensor for tensor, for `h3`)
    at `count` ranks for each of `archs`, without building any checkpoint."""
    plan = ParallelPlan.for_preset(preset_name, count, mode, width=width, height=height, frames=frames, text_tokens=text_tokens,
                                   cfg_parallel=cfg_parallel, replicas=replicas)
    problems = [p for p in (dry_run_problem(a) for a in archs) if p]
    runs, first, adapters = [], None, []
    for arch in archs if not problems else ():
        run = preset_run(plan, preset_name, arch, width=width, height=height, frames=frames, decoded_weights=decoded_weights, loras=loras)
        first, adapters = first or run.plan, adapters or run.adapters
        runs.append(dry_run(run, arch))
    if problems and loras:
        adapters = preset_run(plan, preset_name, "cpu", width=width, height=height, frames=frames, loras=loras).adapters
    return PlanMemory(plan=first or plan, dry_runs=runs, skipped=problems[0] if problems else None, adapters=adapters)


def preset_run(plan: ParallelPlan, preset_name: str, arch: str, *, width: int | None = None, height: int | None = None,
               frames: int | None = None, decoded_weights: str = "auto", steps: int | None = None, loras: Sequence = ()) -> ResolvedRun:
    """A resolved run of a preset's synthetic checkpoint for `plan` on a GPU of `arch` (its example's memory),
    with the decoded-weights choice made for that GPU and the LoRA adapters `loras` (`LoraSpec`s,
    checked and costed on the plan); the checkpoint is not built (the dry run needs its specs only)."""
    from h3core.generate.memory import plan_decoded_weights
    from h3core.generate.request import GenerateRequest, RunShape
    from h3core.lora.plan import adapter_records, open_adapters
    from h3core.model.config import preset
    from h3core.model.synthetic import synthetic_specs
    from h3core.runtime.limits import CUDA_CONTEXT_BYTES

    config = preset(preset_name)
    on_gpu = arch != "cpu"
    request = GenerateRequest(preset=preset_name, mode=plan.mode, world_size=plan.layout.world_size, replicas=plan.layout.replicas,
                              cfg_parallel=plan.layout.cfg_parallel, guidance_scale=2.0 if plan.layout.guided else 1.0,
                              width=width, height=height, frames=frames, steps=steps, device="cuda" if on_gpu else "cpu", decoded_weights=decoded_weights)  # type: ignore[arg-type]
    shape = RunShape.of(config, request)
    dtype = torch.bfloat16 if on_gpu else torch.float32
    prefixes = sorted({s.prefix for s in synthetic_specs(config) if s.name.endswith(".weight_scale")})
    spec = ARCHS.get(arch)
    elements = shape.latent_elements
    decided = plan_decoded_weights(plan, config, decoded_weights, prefixes, capability=spec.capability if spec else None,
                                   gpu_bytes=spec.total_memory - CUDA_CONTEXT_BYTES if spec else None,
                                   latent_elements=elements, steps=shape.steps, dtype=dtype, attention="sdpa")
    adapters = adapter_records(open_adapters(loras, config), config, decided, dtype)
    return ResolvedRun(request=request, config=config, checkpoint=Path(f"synthetic-{preset_name}.safetensors"), synthetic=True, shape=shape, plan=decided,
                       adapters=adapters)


# --- python -m h3core.generate.dryrun: a prediction against a run's report (scripts/gpu_check.sh) -----------


def compare_with_report(report_path: Path, arch: str | None = None) -> dict:
    """The dry run of the run an `h3 generate --json` report describes (its preset's synthetic layout,
    mode, count and size) next to the peaks its ranks measured (`peak_memory_sampling_bytes`)."""
    import json

    report = json.loads(Path(report_path).read_text())
    plan = ParallelPlan.model_validate(report["partition"])
    shape = report.get("shape", {})
    arch = arch or (arch_of(torch.cuda.get_device_capability(0)) if torch.cuda.is_available() else "sm_120")
    run = preset_run(plan, plan.preset, arch, width=shape.get("width"), height=shape.get("height"), frames=shape.get("frames"), decoded_weights="off")
    predicted = dry_run(run, arch)
    measured = [r["peak_memory_sampling_bytes"] for r in sorted(report["ranks"], key=lambda r: r["rank"])]
    sampling = {r.rank: r.peak_sampling for r in predicted.ranks} | {o: r.peak_sampling for r in predicted.ranks for o in r.same_as}
    rows = [{"rank": i, "predicted_sampling_peak": sampling[i], "measured_sampling_peak": m, "predicted_over_measured": sampling[i] / m if m else None}
            for i, m in enumerate(measured)]
    return {"arch": arch, "preset": plan.preset, "mode": plan.mode.value, "ranks": rows, "dry_run_seconds": predicted.seconds}


if __name__ == "__main__":
    import json
    import sys

    print(json.dumps(compare_with_report(Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else None), indent=1))
