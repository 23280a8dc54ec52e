"""One rank's pipeline: the model loaded and parallelized once, then a request denoised.

`rank_generate(ctx, run)` is the whole run on one rank (every rank calls it; world size 1 is the
same code):

0. the process groups of the run's layout (`RankGroups`): the rank's sequence group (the plan's
   ranks) and, with CFG parallel, the group of both halves of its replica;
1. rank 0 encodes the prompt (and the negative prompt) and releases the encoder; the hidden
   states reach every rank of the run by broadcast (`encode_prompts`);
2. `RankPipeline.load`: the model is loaded (tensor mode: without the linears it reads as shards)
   and `parallelize`d for the run's plan: the heavy part, done once;
3. `RankPipeline.denoise`: seeded noise (the same on every rank, whatever the world size) is
   patchified and the rank keeps its own rows: the residual stream and the latent state stay
   token-sharded for the whole loop (`h3core.generate.loop`); at the end the latent rows are
   gathered once within each group of branch 0 and unpatchified on the rank that leads each
   replica (rank 0 for replica 0).

A pipeline holds no request: `denoise` runs one request's sequences, so a loaded pipeline can run
several requests. `RankPipeline.unparallelized` is the baseline the distributed layer is measured
against at one rank: the same model, `parallelize` never called.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from h3core.generate.fp4gate import install_on_rank
from h3core.generate.loop import Denoiser, StepGate, denoise
from h3core.generate.profile import profiling
from h3core.generate.report import HeldWeights, RankReport, StepDone
from h3core.generate.request import ResolvedRun
from h3core.generate.sequences import Latent, build_sequence, noise_rows
from h3core.model.checkpoint import Checkpoint
from h3core.model.dit import H3Model, tensor_parallel_prefixes, unpack_audio, unpatchify_video
from h3core.model.sampler import FlowMatchH3
from h3core.model.sequence import SegmentKind
from h3core.parallel.collectives import broadcast_tensors
from h3core.parallel.decoded import apply_decoded
from h3core.parallel.layout import RankGroups
from h3core.parallel.parallelize import left_out_at_load, parallelize
from h3core.parallel.runtime import ParallelRuntime
from h3core.parallel.modes.tensor import block_linears
from h3core.runtime import cpu_memory, device as dev
from h3core.runtime.context import RankContext

if TYPE_CHECKING:
    from h3core.text import TextEncoder


@dataclass
class RankPipeline:
    """One rank's loaded denoiser, parallelized for a plan: `load` once, then `denoise` requests."""

    model: H3Model
    runtime: ParallelRuntime
    device: torch.device
    dtype: torch.dtype
    weights: HeldWeights
    timings: dict[str, float] = field(default_factory=dict)

    @classmethod
    def load(cls, ctx: RankContext, run: ResolvedRun, runtime: ParallelRuntime) -> "RankPipeline":
        """Load the checkpoint for this rank and `parallelize` it (tensor mode reads only its shards)."""
        return cls._load(ctx, run, runtime, parallel=True)

    @classmethod
    def unparallelized(cls, ctx: RankContext, run: ResolvedRun, runtime: ParallelRuntime) -> "RankPipeline":
        """The baseline of the distributed layer at one rank: the whole model, `parallelize` never called."""
        if runtime.world_size != 1:
            raise ValueError("the unparallelized pipeline runs on one rank only")
        return cls._load(ctx, run, runtime, parallel=False)

    @classmethod
    def _load(cls, ctx: RankContext, run: ResolvedRun, runtime: ParallelRuntime, parallel: bool) -> "RankPipeline":
        device, dtype = ctx.device, dev.compute_dtype(ctx.device.type, run.request.dtype)
        install_on_rank(run, device)  # the launcher's fp4 self-test of this GPU decides its linears' path
        with dev.Stopwatch(device) as watch:
            checkpoint = Checkpoint.open(run.checkpoint, run.config)
            skip = left_out_at_load(run.plan, run.config.num_blocks) if parallel else ()
            model = checkpoint.load(device=device, dtype=dtype, skip=skip)
            for block in [*model.blocks, *model.token_refiner.blocks]:
                block.attn.core.backend = run.request.attention
            loaded = checkpoint.bytes_read
            if parallel:
                parallelize(model, runtime, checkpoint.weight_source(device, dtype))
            apply_decoded(model, run.plan.decoded)
            runtime.record.attach(model)
        weights = _held_weights(model, checkpoint, shards_read=checkpoint.bytes_read - loaded if skip else None)
        checkpoint.file.reader.close()
        return cls(model, runtime, device, dtype, weights, {"load": watch.seconds})

    def denoise(self, run: ResolvedRun, texts: list[torch.Tensor], record: RankReport, report: Any = None, gate: StepGate | None = None) -> Latent:
        """Denoise one request of `run` (its sequences' text hidden states `texts`) on this rank,
        recording what ran into `record`; the whole latent rows (gathered on branch 0, else {}).
        `gate`: asked before every step (`h3core.generate.loop.denoise`); None for a run that always ends."""
        with torch.inference_mode():
            sequences = [build_sequence(self.model, plan, text, run.shape, self.device) for plan, text in zip(run.plan.sequences, texts)]
        schedules = {SegmentKind.VIDEO: FlowMatchH3(run.shape.video_shift), SegmentKind.AUDIO: FlowMatchH3(run.shape.audio_shift)}
        for schedule in schedules.values():
            schedule.set_timesteps(run.shape.steps)
        denoiser = Denoiser(self.model, self.runtime, sequences, run.request.guidance_scale, schedules, self.runtime.cfg)
        latent = denoiser.own_rows(noise_rows(run.shape, run.request.seed), self.device)  # float32
        _start_sampling_window(self.device)
        self.runtime.record.clear()
        on_step = (lambda step, steps, seconds: report(StepDone(step=step, steps=steps, seconds=seconds))) if report else (lambda *a: None)
        with torch.inference_mode(), profiling(self.model, self.device, self.runtime.rank, run.request.profile, self.runtime.stats) as profiler:
            latent, step_seconds = denoise(denoiser, latent, self.device, profiler, on_step, gate)
            peak = dev.peak_memory_bytes(self.device)
            with dev.Stopwatch(self.device) as watch:  # branch 1 holds the same values: branch 0 gathers
                whole = denoiser.gather(latent) if denoiser.own == 0 else {}
        record.step_seconds, record.peak_memory_sampling_bytes = step_seconds, peak
        record.timings.update(sampling=sum(step_seconds), gather=watch.seconds)
        record.nvfp4_paths, record.attention_kernels = self.runtime.record.paths(), self.runtime.record.kernels()
        record.fp4_gemm_shapes = self.runtime.record.gemm_shapes()
        record.profile = profiler.result() if profiler is not None else None
        return whole


def _held_weights(model: H3Model, checkpoint: Checkpoint, shards_read: int | None) -> HeldWeights:
    """What the rank holds and read; `shards_read`: bytes tensor mode read as shards (None: the block
    linears were read whole at load)."""
    full = checkpoint.bytes_under(tensor_parallel_prefixes(checkpoint.config.num_blocks))
    return HeldWeights(
        resident=dev.resident_bytes(model),
        read=checkpoint.bytes_read,
        block_linears_resident=sum(dev.resident_bytes(m) for m in block_linears(model)),
        block_linears_read=full if shards_read is None else shards_read,
        block_linears_full=full,
    )


# --- the whole run on one rank ----------------------------------------------------------------------------


def encode_prompts(ctx: RankContext, run: ResolvedRun, runtime: ParallelRuntime, record: RankReport) -> list[torch.Tensor]:
    """Rank 0 encodes the request's prompts (and releases the encoder); every rank of the run gets
    the hidden states by broadcast. The time, peak memory and (rank 0) the encoder's info go to `record`."""
    dev.reset_peak_memory(ctx.device)
    with dev.Stopwatch(ctx.device) as watch:
        texts, info = _encode_on_rank_zero(run, ctx.device) if ctx.rank == 0 else (None, None)
        texts = broadcast_tensors(texts, src=0, group=ctx.group, device=ctx.device, stats=runtime.stats)
    record.timings["text_encode"], record.peak_memory_text_bytes, record.text_encoder = watch.seconds, dev.peak_memory_bytes(ctx.device), info
    return texts


def _encode_on_rank_zero(run: ResolvedRun, device: torch.device) -> tuple[list[torch.Tensor], dict]:
    from h3core.text import release_text_encoder

    encoder = open_text_encoder(run, device)
    texts = encode_request(encoder, run)
    info = encoder.info.model_dump(mode="json")
    release_text_encoder(encoder)
    return texts, info


def open_text_encoder(run: ResolvedRun, device: torch.device) -> "TextEncoder":
    """The text encoder `run` names, loaded on `device` in the run's compute dtype."""
    from h3core.text import load_text_encoder

    dtype = dev.compute_dtype(device.type, run.request.dtype)
    return load_text_encoder(run.request.text_encoder_path, hidden_size=run.config.text_dim, seed=0, device=device, dtype=dtype)


def encode_request(encoder: "TextEncoder", run: ResolvedRun) -> list[torch.Tensor]:
    """The float32 CPU hidden states of the request's prompts (the prompt's, then the negative prompt's)."""
    return [encoder.encode(p, run.config.max_text_tokens).float().cpu() for p in run.request.prompts]


def rank_generate(ctx: RankContext, run: ResolvedRun, load=RankPipeline.load) -> RankReport:  # type: ignore[no-untyped-def]
    """The whole run on one rank (module docstring): this rank's report, filled as the run goes;
    `load` builds the pipeline (the baseline passes `RankPipeline.unparallelized`)."""
    record = new_record(ctx)
    runtime = rank_runtime(ctx, run)
    texts = encode_prompts(ctx, run, runtime, record)
    pipeline = load(ctx, run, runtime)
    record.timings.update(pipeline.timings)
    whole = pipeline.denoise(run, texts, record, ctx.report)
    return finish_record(record, run, pipeline, whole)


def rank_runtime(ctx: RankContext, run: ResolvedRun) -> ParallelRuntime:
    """This rank's runtime: its group's plan, its local rank, its sequence group and CFG half.

    `ctx` holds exactly the run's ranks. Creating the layout's groups is collective over the World:
    a task that runs on the first ranks of a larger World creates them on every rank first
    (`RankGroups.create` on the World's context; they are cached), as `first_ranks` does.
    """
    layout = run.plan.layout
    if ctx.world_size != layout.world_size:
        raise ValueError(f"a run laid out over {layout.world_size} ranks given a context of {ctx.world_size}")
    groups = RankGroups.create(ctx, layout)
    assert groups is not None  # every rank of ctx is in the layout
    return ParallelRuntime(run.plan, groups.coords.local, groups.sequence, groups.cfg_half)


def _start_sampling_window(device: torch.device) -> None:
    """The sampling phase's peak-memory window starts here (the dry run starts its tracker's with it)."""
    dev.reset_peak_memory(device)


def new_record(ctx: RankContext) -> RankReport:
    """The report this rank fills for one request."""
    return RankReport(rank=ctx.rank, cpu_allocator=cpu_memory.policy() if ctx.device.type == "cpu" else "n/a")


def finish_record(record: RankReport, run: ResolvedRun, pipeline: RankPipeline, whole: Latent) -> RankReport:
    """The rank's report once its request is done: what it holds, moved and used; the lead of each
    replica (local rank 0 of branch 0) carries the latents."""
    record.weights, record.comm, record.used = pipeline.weights, pipeline.runtime.stats, pipeline.runtime.used
    if pipeline.runtime.rank == 0 and whole:
        record.carry(*_unpatchified(run, whole))
    return record


def _unpatchified(run: ResolvedRun, latent: Latent) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The whole latent as `[24, T, H/16, W/16]` video and `[2, 32, T_a]` audio (None for a kind the run has none of)."""
    shape = run.shape
    video, audio = latent.get(SegmentKind.VIDEO), latent.get(SegmentKind.AUDIO)
    return (
        unpatchify_video(video.cpu(), shape.video_latent, shape.patch) if video is not None else None,
        unpack_audio(audio.cpu()) if audio is not None else None,
    )
