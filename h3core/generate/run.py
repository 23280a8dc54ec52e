"""`generate(job)`: the one call behind `h3 generate`, and the runs around the ranks.

In the calling process: resolve the request (`h3core.generate.request`), reserve the output folder
(`h3core.reports.outputs`), launch every rank in a fresh World (`execute`), turn their outcomes into a
`RunReport` plus files, and publish them only after every rank succeeded (on any failure or Ctrl-C
nothing is written). With `--parity` the run is compared with a one-rank run of the same request
(`reference_parity`).
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Mapping

import torch

from h3core import settings
from h3core.decode.plan import DecodePlan, plan_decode
from h3core.decode.run import ClipLabel, DecodeRun, Phase, no_phase
from h3core.generate.decode_ranks import decode_run, rank_decode
from h3core.errors import ConfigError
from h3core.generate.files import clip_title, output_bytes, write_outputs
from h3core.generate.fp4gate import with_fp4_selftest
from h3core.generate.parity import LatentParity, latent_parity, run_tolerance
from h3core.generate.pipeline import rank_generate
from h3core.generate.dryrun import DryRun, check_device_memory
from h3core.generate.report import RankReport, RunReport, StepDone, build_report, request_fingerprint, weights_label
from h3core.model.checkpoint import SYNTHETIC
from h3core.generate.request import GenerateJob, GenerateRequest, ResolvedRun, build_plan, check_torchrun_parity, resolve
from h3core.generate.wall import WallClock
from h3core.parallel.modes import Mode
from h3core.reports.outputs import Outputs
from h3core.runtime import device as dev
from h3core.runtime.world import World

if TYPE_CHECKING:
    from h3core.decode.sources import VaeChoice
    from h3core.decode.vae_files import Role

StepCallback = Callable[[StepDone], None]


@dataclass
class Executed:
    """What a run's ranks gave: every rank's outcome (rank 0's first, with the latents) and, when
    asked for, the decode they shared out (`h3core.generate.decode_ranks`, `h3core.decode.spread`)."""

    outcomes: list[RankReport]
    decode: DecodeRun | None = None


def execute(run: ResolvedRun, on_step: StepCallback | None = None) -> list[RankReport] | None:
    """Run every rank of `run` in a fresh World; rank 0's outcome (first) carries the latents.

    Under torchrun every process calls this; only rank 0 gets the outcomes, the others None.
    """
    done = run_ranks(run, on_step)
    return done.outcomes if done is not None else None


def run_ranks(
    run: ResolvedRun, on_step: StepCallback | None = None, decode: DecodePlan | None = None, on_phase: Phase = no_phase, wall: WallClock | None = None,
) -> Executed | None:
    """`execute`, then (with `decode`) the decode of rank 0's latents on every rank of the same World
    while the ranks are up (`rank_decode`: tiles on every rank, audio on the last, the clip on rank 0).
    `wall` is marked `ranks` when the latents are in and `decode` when the clip is."""
    run = with_fp4_selftest(run)  # CUDA fp4: each GPU's GEMM checked before any rank (a no-op when `run` carries it)
    with World(run.request.world_size, run.request.device, on_progress=on_step) as world:
        world.agree(request_fingerprint(run, portable=True), "request")  # torchrun: the run rank 0 resolved, or none
        try:
            outcomes = world.run(rank_generate, run)
            _mark(wall, "ranks")
            decoded = None
            if decode is not None:
                on_phase(f"decoding on {run.request.world_size} rank{'s' if run.request.world_size > 1 else ''}")
                decoded = decode_on_ranks(world, decode.vaes, outcomes[0].latents if world.is_main else None, run)
                _mark(wall, "decode")
        finally:
            if run.request.world_size == 1:  # it ran in this process: nothing of it may stay on a device
                world.close()
                dev.release_memory(run.request.device)
        if not world.is_main:
            return None
        return Executed(outcomes, decoded)


def decode_label(run: ResolvedRun) -> ClipLabel:
    """The label of `run`'s decoded clip (its preview's title; synthetic when its transformer is)."""
    req = run.request
    return ClipLabel(clip_title(req.mode.value, req.world_size, req.seed), synthetic=weights_label(run) == SYNTHETIC)


def _mark(wall: WallClock | None, stage: str) -> None:
    if wall is not None:
        wall.mark(stage)


def decode_device(run: ResolvedRun) -> str:
    """Where rank 0 decoded: its device, as the report names it."""
    return str(dev.rank_device(dev.resolve_device(run.request.device), 0))


def decode_on_ranks(world: World, vaes: "Mapping[Role, VaeChoice]", latents: "Mapping[str, torch.Tensor] | None", run: ResolvedRun) -> DecodeRun | None:
    """`run`'s latents (rank 0's; None elsewhere) decoded on every rank of `world` (`rank_decode`: tiles
    on every rank, the audio on the last, the clip and its mp4 on rank 0, the VAEs held for the next
    call); the clip in the main process, None in the others (`h3 generate`, a batch's prompts, a
    server's jobs)."""
    parts = world.run(rank_decode, vaes, latents, decode_label(run))
    return decode_run(parts, decode_device(run)) if world.is_main else None


def one_rank_latents(
    run: ResolvedRun, *, mode: Mode | None = None, threads: int | None = None, on_step: StepCallback | None = None
) -> dict[str, torch.Tensor | None]:
    """`run` on one rank in this process (in `mode` if given), at `threads` CPU intra-op threads.

    The reference every parity figure is measured against. On the CPU pass the compared ranks'
    thread count: kernels block by thread count, and the comparison is meant to isolate the
    distribution, not the machine's threading.
    """
    update = {"world_size": 1, "cfg_parallel": False, "replicas": 1} | ({"mode": mode} if mode is not None else {})
    request = run.request.model_copy(update=update)
    one = run.model_copy(update={"request": request, "plan": build_plan(request, run.config, run.shape)})
    with dev.cpu_threads(threads) if threads else nullcontext():
        (outcome,) = execute(one, on_step)  # type: ignore[misc]
    return outcome.latents


def reference_parity(run: ResolvedRun, outcome: RankReport) -> LatentParity:
    """Compare with the single-rank reference (at one rank: the other mode, the identity path)."""
    req = run.request
    other = next(m for m in Mode if m != req.mode)
    mode = other if req.world_size == 1 else req.mode
    name = f"1 rank, {mode.value} mode" + (" (the identity path)" if req.world_size == 1 else "")
    threads = dev.cpu_threads_per_rank(req.world_size) if req.device == "cpu" else None
    reference = one_rank_latents(run, mode=mode, threads=threads)
    tol = run_tolerance(req.mode, dev.compute_dtype(req.device, req.dtype), outcome.nvfp4_paths)
    return latent_parity(outcome.latents, reference, tol, name)


def check_one_group(request: GenerateRequest) -> None:
    """One prompt runs on one group: replica groups need prompts to share out (`--prompts`)."""
    if request.replicas > 1:
        raise ConfigError(
            f"--replicas {request.replicas} runs independent groups that share the prompts of --prompts FILE out; "
            "one prompt runs on one group: give --prompts FILE, or leave --replicas out to run it on all the ranks"
        )


def plan_run_decode(job: GenerateJob, run: ResolvedRun, beside_bytes: int = 0) -> DecodePlan | None:
    """The decode `run` ends with (its VAEs found and checked, its memory checked), or None with --no-decode."""
    if not job.decode:
        return None
    s = run.shape
    return plan_decode(job.video_vae, job.audio_vae, run.request.model_path, synthetic_transformer=run.synthetic,
                       width=s.width, height=s.height, frames=s.frames, device=run.request.device, beside_bytes=beside_bytes,
                       ranks=run.request.world_size)


@dataclass(frozen=True)
class ResolvedJob:
    """A `GenerateJob` with every check done: the run the ranks execute and the decode that follows."""

    job: GenerateJob
    run: ResolvedRun
    decode: DecodePlan | None


def resolve_job(job: GenerateJob) -> ResolvedJob:
    """Every check of `h3 generate` before any rank starts, in this order: the flags that need one
    prompt or no torchrun, the request (`resolve`: config, sizes, plan, backends, the host's memory,
    the GPUs' memory (the dry run's predicted peaks on CUDA, the formula where no dry run can run or
    one failed: `run.memory_check` says which), then the weights), the decode (VAEs and their
    memory), and the fp4 GEMM self-test of every GPU at the shapes the dry run called."""
    check_torchrun_parity(job.parity)
    check_one_group(job.request)
    predicted: list[DryRun] = []

    def check_gpus(run: ResolvedRun) -> ResolvedRun:  # CUDA: the dry run of the ranks' own code predicts each rank's peak
        memory, dry = check_device_memory(run)
        predicted.extend([dry] if dry is not None else [])
        return run.model_copy(update={"memory_check": memory})

    run = resolve(job.request, video_vae=job.video_vae, check_gpus=check_gpus)
    decode = plan_run_decode(job, run)
    run = with_fp4_selftest(run, predicted[0].gemm_shapes() if predicted else None)  # ... and the fp4 GEMMs it will call
    return ResolvedJob(job, run, decode)


def generate(job: GenerateJob, on_step: StepCallback | None = None, on_phase: Phase | None = None) -> RunReport | None:
    """Resolve (`resolve_job`), reserve the output folder, launch every rank, decode the latents on
    every rank once they are denoised (`run_ranks`), write video.mp4 here, and publish the report
    with its files (only after all of it succeeded; on any failure or Ctrl-C nothing is written).

    Returns None on the ranks of a torchrun launch other than rank 0 (which writes everything).
    """
    wall = WallClock()
    run, decode = (resolved := resolve_job(job)).run, resolved.decode
    wall.mark("resolve")
    with Outputs(enabled=settings.is_rank_zero()) as outputs:
        folder = bench = None
        if outputs.enabled:
            kind = f"generate-{run.request.mode.value}{'-cfg' if run.request.cfg_parallel else ''}-{run.request.world_size}"
            folder = outputs.folder(job.output, kind=kind, need_bytes=output_bytes(run, job.save_latents, decode), overwrite=job.overwrite)
            bench = outputs.file(job.benchmark, flag="--benchmark") if job.benchmark is not None else None
        done = run_ranks(run, on_step, decode, on_phase or no_phase, wall)
        if done is None or folder is None:
            return None
        report = build_report(run, done.outcomes)
        if job.parity:
            report.parity = reference_parity(run, done.outcomes[0])
            wall.mark("parity")
        write_outputs(report, done.outcomes[0], folder, job.save_latents, bench, decoded=done.decode, wall=wall)
        outputs.publish()
    return report
