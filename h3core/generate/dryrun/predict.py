"""Predicting a rank's peak: h3's own rank code at a run's real shapes on fake tensors, and the memory
it would take.

`dry_run(run, arch)` executes, for every rank of `run`'s layout (ranks whose local shapes are all
the same are run once), exactly what a rank runs: `RankPipeline.load` (the checkpoint's loader and
`parallelize`: tensor mode reads its shards) and `RankPipeline.denoise` (the sequences, the refined
text, the noise, the denoising loop with its collectives, the final gather), on fake tensors
(`FakeTensorMode`) with a fake process group, and counts every device storage alive at each moment
(`h3core.runtime.fake_cuda.StorageTracker`). The pipeline is given fake instruments
(`h3core.generate.dryrun.fakes`): the seams it offers, nothing patched.

`arch` is the GPU the run is predicted for (`ARCHS`): `sm_90` (Hopper: the NVFP4 linears take
`cuda-dequant-bf16`) or `sm_120` (Blackwell: `cuda-fp4-scaled-mm`, with the fused Triton
quantizer's allocations and the fp4 self-test taken as passed). A CPU-only torch needs the no-op
CUDA device guard to make fake CUDA tensors (`cuda_guard_problem`). With `arch="cpu"` the same
code runs on fake CPU tensors (how the tests compare a prediction with a real CPU run).

What comes back per rank (`RankPrediction`): the device peak while loading, the peak of the
sampling phase (the window `torch.cuda.max_memory_allocated` covers in a run's report:
`peak_memory_sampling_bytes`), the live bytes after each step (equal from step to step, or something
grows), the host syncs the CUDA path makes (a value read or a copy to the host, with the h3 line:
`check_finite`'s one per step is by design), and the NVFP4 paths and attention kernels it took. A
dry run that cannot finish raises `DryRunFailed`: one line naming the rank, the error and the h3
line it came from. It runs `steps` forwards (default 2, the first and a steady one), not the run's
49: the peak of a step does not depend on which step it is.
"""

from __future__ import annotations

import time
import traceback
from contextlib import ExitStack
from pathlib import Path
from typing import Callable, Sequence

import torch
from pydantic import BaseModel, ConfigDict, Field

from h3core.errors import DryRunFailed, H3Error
from h3core.generate.dryrun.fakes import FakeInstruments, TrackedMeter, fake_instruments
from h3core.generate.instruments import RankInstruments
from h3core.generate.report import HeldWeights
from h3core.generate.request import ResolvedRun
from h3core.model.sequence import SegmentKind
from h3core.nvfp4.kernels import DeviceKernels
from h3core.nvfp4.matmul import PATH_CUDA_BF16, PATH_CUDA_FP4
from h3core.runtime import fake_cuda
from h3core.runtime.context import RankContext

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


def arch_of(capability: tuple[int, int]) -> str:
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


def dry_run(run: ResolvedRun, arch: str, steps: int = DEFAULT_STEPS, *, fakes: FakeInstruments = fake_instruments) -> DryRun:
    """Run every distinct rank of `run` on fake tensors for `arch` (module docstring); `DryRunFailed`
    (one line) where it cannot run here or a rank's code fails. `fakes`: what makes each rank's
    instruments (the dry run's own; a test passes one with a seam broken on purpose)."""
    problem = dry_run_problem(arch)
    if problem is not None:
        raise DryRunFailed(f"no dry run here: {problem}")
    started = time.perf_counter()
    short = _short(run, steps)
    ranks = []
    for rank, same in _distinct_ranks(run).items():
        prediction = _rank_dry_run(short, arch, rank, fakes=fakes)
        ranks.append(prediction.model_copy(update={"same_as": same}))
    return DryRun(arch=arch, device="cpu" if arch == "cpu" else "cuda", mode=run.plan.mode.value, world_size=run.plan.layout.world_size,
                  preset=run.config.name, steps_simulated=short.shape.steps, ranks=ranks, seconds=time.perf_counter() - started)


def measured_cpu_run(run: ResolvedRun, rank: int = 0, steps: int = DEFAULT_STEPS) -> RankPrediction:
    """The same rank code on real CPU tensors from `run`'s real checkpoint, its live storage counted the
    same way: what `dry_run(run, "cpu")` predicts, measured (tests compare the two)."""
    return _rank_dry_run(_short(run, steps), "cpu", rank, fake=False)


def _short(run: ResolvedRun, steps: int) -> ResolvedRun:
    return run.model_copy(update={"shape": run.shape.model_copy(update={"steps": min(steps, run.shape.steps)})})


def _distinct_ranks(run: ResolvedRun) -> dict[int, list[int]]:
    """The layout's ranks of the first replica grouped by what shapes their code sees: {first: others}
    (a rank's shapes follow from its branch, its plan entry and whether it is rank 0; the other
    replicas are copies of the first)."""
    from h3core.parallel import partition

    layout, plan = run.plan.layout, run.plan
    first: dict[tuple, int] = {}
    groups: dict[int, list[int]] = {}
    for rank in range(layout.world_size):
        c = layout.coords(rank)
        mine = plan.ranks[c.local]
        clipped = [partition.clip_segments(seq.segments, seq.tokens[c.local]) for seq in plan.sequences]
        key = (c.branch, rank == 0, len(mine.heads),
               tuple(tuple((s.kind, len(s)) for s in segments) for segments in clipped),
               _sizes(mine.tensor.model_dump()) if mine.tensor else None)
        if key in first:
            groups[first[key]].append(rank)
        else:
            first[key] = rank
            groups[rank] = []
    return groups


def _sizes(value: object) -> object:
    """`value` (a dumped plan entry) with every span `{start, stop}` replaced by its length: where a
    rank's shard sits does not change the shapes its code sees, only how much it holds (tensor mode's
    8 ranks of 7 heads each are one dry run, not 8)."""
    if isinstance(value, dict):
        if value.keys() == {"start", "stop"}:
            return value["stop"] - value["start"]
        return tuple(sorted((k, _sizes(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_sizes(v) for v in value)
    return value


# --- one rank ---------------------------------------------------------------------------------------


def _rank_dry_run(run: ResolvedRun, arch: str, rank: int, fake: bool = True, fakes: FakeInstruments = fake_instruments) -> RankPrediction:
    """One rank's load and denoise under the tracker: on fake tensors (the dry run), or with `fake=False`
    on real CPU tensors from the real checkpoint (the measurement a CPU prediction is compared with)."""
    try:
        return _rank_under_tracker(run, arch, rank, fake, fakes)
    except H3Error:
        raise
    except Exception as err:  # the rank's own code failed on fake tensors: say which rank, what and where
        raise DryRunFailed(f"the dry run of rank {rank} ({arch}) failed: {type(err).__name__}: {_first_line(err)} (at {_h3_line(err)})") from err


def _rank_under_tracker(run: ResolvedRun, arch: str, rank: int, fake: bool, fakes: FakeInstruments) -> RankPrediction:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from h3core.generate.pipeline import RankPipeline, new_record, rank_runtime

    device = torch.device("cpu") if arch == "cpu" else torch.device("cuda", 0)
    kind, tracker, world = device.type, fake_cuda.StorageTracker(), run.plan.layout.world_size
    with ExitStack() as stack:
        group = stack.enter_context(fake_cuda.fake_world(rank, world))
        if fake:
            mode = FakeTensorMode(allow_non_fake_inputs=True)
            instruments = fakes(run, device, tracker, mode, ARCHS[arch].capability if arch in ARCHS else None)  # the header: before the fake mode
            stack.enter_context(mode)
        else:
            instruments = RankInstruments(meter=TrackedMeter(device, tracker), kernels=DeviceKernels.of(device))
        stack.enter_context(tracker)
        ctx = RankContext(rank, world, rank, device, group, "fake" if group is not None else "none")
        runtime = rank_runtime(ctx, run)
        pipeline = RankPipeline.load(ctx, run, runtime, instruments)
        peak_load, resident = tracker.peak(kind), tracker.live(kind)
        tracker.phase = "sampling"
        live_after: list[int] = []
        texts = _conditioning(run, rank, device)
        done = pipeline.denoise(run, texts, new_record(ctx), report=lambda step: live_after.append(tracker.live(kind)))
        peak_sampling, peak_total = tracker.peak(kind), tracker.highest(kind)
        paths, kernels, shapes = runtime.record.paths(), runtime.record.kernels(), runtime.record.gemm_shapes()
        weights = pipeline.weights
        del pipeline, done, texts
    return RankPrediction(
        rank=rank, peak_load=peak_load, peak_sampling=peak_sampling, peak_total=peak_total, resident_after_load=resident,
        live_after_steps=live_after, weights=weights, host_syncs=_counted(tracker.syncs), nvfp4_paths=paths, attention_kernels=kernels,
        fp4_gemm_shapes=shapes,
    )


def _conditioning(run: ResolvedRun, rank: int, device: torch.device) -> "Conditioning":
    """What rank 0's broadcast hands every rank: each sequence's text states (float32 `[L, text_dim]`)
    and the keyframes' latents; on the rank's device when they travelled, on the host at one rank."""
    from h3core.generate.sequences import Conditioning

    where = device if run.plan.layout.world_size > 1 else torch.device("cpu")
    texts = [[s for s in seq.segments if s.kind is SegmentKind.TEXT] for seq in run.plan.sequences]
    states = [torch.randn(sum(len(s) for s in text), run.config.text_dim, dtype=torch.float32, device=where) for text in texts]
    keyframes = torch.randn(run.shape.condition_latent, dtype=torch.float32, device=where) if run.shape.keyframes else None
    return Conditioning(states, keyframes)


def _counted(syncs: Sequence[fake_cuda.HostSync]) -> list[HostSyncCount]:
    counts: dict[fake_cuda.HostSync, int] = {}
    for sync in syncs:
        counts[sync] = counts.get(sync, 0) + 1
    return [HostSyncCount(what=s.what, op=s.op, where=s.where, phase=s.phase, count=n) for s, n in counts.items()]


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0][:300] if text else "(no message)"


def _h3_line(err: BaseException) -> str:
    """The innermost frame of `err`'s traceback in h3's own code: 'h3core/...py:123 function'."""
    root = Path(__file__).resolve().parents[3]
    found = "outside h3"
    for frame in traceback.extract_tb(err.__traceback__):
        path = Path(frame.filename).resolve()
        if path.is_relative_to(root / "h3core") and path.name != "fake_cuda.py":  # the tracker sees every op: not where it failed
            found = f"{path.relative_to(root)}:{frame.lineno} {frame.name}"
    return found
