"""One rank's pipeline: the model loaded and parallelized once, then a request denoised.

`rank_generate(ctx, run)` is the whole run on one rank (every rank calls it; world size 1 is the
same code):

0. the process groups of the run's layout (`RankGroups`): the rank's sequence group (the plan's
   ranks) and, with CFG parallel, the group of both halves of its replica;
1. rank 0 encodes the keyframes (if any) with the video VAE's encoder alone and releases it, then
   the prompt (and the negative prompt; with keyframes each presented after their vision blocks,
   the rows' tags checked against the plan) and releases the text encoder; the hidden states and
   the keyframe latents reach every rank of the run by broadcast (`encode_prompts`, a `Conditioning`);
2. `RankPipeline.load`: the model is loaded (tensor mode: without the linears it reads as shards)
   and `parallelize`d for the run's plan: the heavy part, done once;
3. `RankPipeline.denoise`: seeded noise of the request's recipe (the same on every rank, whatever
   the world size) is patchified and the rank keeps its own rows (keyframe condition rows: noised
   once from it, every rank the same): the residual stream and the latent state stay
   token-sharded for the whole loop (`h3core.generate.loop`); at the end the latent rows are
   gathered once within each group of branch 0 and unpatchified on the rank that leads each
   replica (rank 0 for replica 0).

A pipeline holds no request: `denoise` runs one request's sequences, so a loaded pipeline can run
several requests. `RankPipeline.unparallelized` is the baseline the distributed layer is measured
against at one rank: the same model, `parallelize` never called.

What the pipeline measures and asks with (its device's stopwatch and peak window, what the device
can run, host arithmetic, the checkpoint file) comes in as one `RankInstruments`
(`h3core.generate.instruments`), the real ones by default: a dry run passes its fakes, nothing is
patched.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from h3core.generate.instruments import RankInstruments
from h3core.generate.compile_record import CompileRecord
from h3core.model.compiled import CompiledBlocks
from h3core.model.step_cache import CachePolicy
from h3core.generate.loop import Denoiser, StepDoneCallback, StepGate, denoise
from h3core.generate.profile import profiling
from h3core.generate.report import HeldWeights, RankReport, StepDone
from h3core.generate.request import ResolvedRun
from h3core.generate.sequences import Conditioning, Latent, build_sequence, check_text_tags, condition_rows, noise_rows
from h3core.model.checkpoint import Checkpoint
from h3core.model.dit import H3Model, unpack_audio, unpatchify_video
from h3core.model.sampler import FlowMatchH3
from h3core.model.sequence import SegmentKind
from h3core.parallel.collectives import broadcast_tensors
from h3core.parallel.decoded import apply_decoded
from h3core.parallel.layout import RankGroups
from h3core.parallel.parallelize import left_out_at_load, parallelize
from h3core.parallel.modes.tensor import block_linears
from h3core.parallel.modes.tensor_shards import tensor_parallel_prefixes
from h3core.parallel.runtime import ParallelRuntime
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
    instruments: RankInstruments
    timings: dict[str, float] = field(default_factory=dict)
    adapters: tuple = ()
    """What the LoRA branches on `model` are: (path, sha256, scale) per adapter (`use_adapters`)."""
    adapter_bytes: int = 0
    compiled: CompiledBlocks | None = None
    """With `--compile`: the blocks' compiled forward (h3core.model.compiled), kept for the pipeline's life."""

    @classmethod
    def load(cls, ctx: RankContext, run: ResolvedRun, runtime: ParallelRuntime, instruments: RankInstruments | None = None) -> "RankPipeline":
        """Load the checkpoint for this rank and `parallelize` it (tensor mode reads only its shards).
        `instruments`: what it measures and asks with (None: the real ones for `ctx.device`)."""
        return cls._load(ctx, run, runtime, instruments or RankInstruments.real(ctx.device, run), parallel=True)

    @classmethod
    def unparallelized(cls, ctx: RankContext, run: ResolvedRun, runtime: ParallelRuntime, instruments: RankInstruments | None = None) -> "RankPipeline":
        """The baseline of the distributed layer at one rank: the whole model, `parallelize` never called."""
        if runtime.world_size != 1:
            raise ValueError("the unparallelized pipeline runs on one rank only")
        return cls._load(ctx, run, runtime, instruments or RankInstruments.real(ctx.device, run), parallel=False)

    @classmethod
    def _load(cls, ctx: RankContext, run: ResolvedRun, runtime: ParallelRuntime, instruments: RankInstruments, parallel: bool) -> "RankPipeline":
        device, dtype, kernels = ctx.device, dev.compute_dtype(ctx.device.type, run.request.dtype), instruments.kernels
        with instruments.meter.stopwatch() as watch:
            checkpoint = instruments.open_checkpoint(run)
            skip = left_out_at_load(run.plan, run.config.num_blocks) if parallel else ()
            model = checkpoint.load(device=device, dtype=dtype, skip=skip, kernels=kernels)  # kernels: the GPU's fp4 verdict decides the linears' path
            model.set_attention_backend(run.request.attention)
            loaded = checkpoint.bytes_read
            if parallel:
                parallelize(model, runtime, checkpoint.weight_source(device, dtype, kernels=kernels))
            apply_decoded(model, run.plan.decoded)
            runtime.record.attach(model)
            compiled = CompiledBlocks(model) if run.request.compile else None  # after the mode: its collectives stay outside
        weights = _held_weights(model, checkpoint, shards_read=checkpoint.bytes_read - loaded if skip else None)
        checkpoint.file.reader.close()
        return cls(model, runtime, device, dtype, weights, instruments, {"load": watch.seconds}, compiled=compiled)

    def use_adapters(self, run: ResolvedRun) -> float:
        """The request's LoRA adapters on the model (h3core.lora.attach), replacing those of an earlier
        request, cut as this rank's linears are; nothing to do when they are the same. The base
        weights are never touched, so a resident pipeline serves any adapters without reloading.
        Returns the seconds it took."""
        from h3core.lora.adapter import open_adapter
        from h3core.lora.attach import attach_adapters, detach_adapters

        wanted = tuple((a.path, a.sha256, a.scale) for a in run.adapters)
        if wanted == self.adapters:
            return 0.0
        with dev.Stopwatch(self.device) as watch, torch.inference_mode():
            if wanted:
                opened = [(open_adapter(a.path, run.config, check_values=False), a.scale) for a in run.adapters]
                self.adapter_bytes = attach_adapters(self.model, opened, self.dtype)
            else:
                detach_adapters(self.model)
                self.adapter_bytes = 0
        self.adapters = wanted
        return watch.seconds

    def denoise(self, run: ResolvedRun, given: Conditioning, record: RankReport, report: Any = None, gate: StepGate | None = None) -> Latent:
        """Denoise one request of `run` (what its sequences are conditioned on: `given`) on this rank,
        recording what ran into `record`; the whole latent rows (gathered on branch 0, else {}).
        `report` gets a `StepDone` after every step; `gate`: asked before every step
        (`h3core.generate.loop.denoise`); None for a run that always ends."""
        record.timings["adapters"] = self.use_adapters(run)
        record.adapter_bytes = self.adapter_bytes
        host, meter = self.instruments.host, self.instruments.meter
        noise = noise_rows(run.shape, run.request.seed, run.request.noise_recipe)
        condition = condition_rows(given.keyframes, noise[SegmentKind.CONDITION], run.shape) if given.keyframes is not None else None
        with torch.inference_mode():
            sequences = [build_sequence(self.model, plan, states, run.shape, self.device, condition, host)
                         for plan, states in zip(run.plan.sequences, given.states)]
        schedules = {SegmentKind.VIDEO: FlowMatchH3(run.shape.video_shift), SegmentKind.AUDIO: FlowMatchH3(run.shape.audio_shift)}
        for kind, schedule in schedules.items():
            host(schedule.set_timesteps, run.shape.steps, run.shape.video_sigmas if kind is SegmentKind.VIDEO else run.shape.audio_sigmas)
        denoiser = Denoiser(self.model, self.runtime, sequences, run.request.guidance_scale, schedules, self.runtime.cfg, host,
                            cache=CachePolicy.parse(run.request.cache))
        latent = denoiser.own_rows(noise, self.device)  # float32
        meter.reset_peak()  # the sampling phase's peak-memory window starts here
        record.memory_before_sampling_bytes = meter.current()
        self.runtime.record.clear()
        told = (lambda step, steps, seconds: report(StepDone(step=step, steps=steps, seconds=seconds))) if report else (lambda *a: None)
        on_step, compile_seconds = self._compile_meter(told)
        with torch.inference_mode(), profiling(self.model, self.device, self.runtime.rank, run.request.profile, self.runtime.stats) as profiler:
            latent, step_seconds = denoise(denoiser, latent, meter, profiler, on_step, gate)
            peak = meter.peak()
            with meter.stopwatch() as watch:  # branch 1 holds the same values: branch 0 gathers
                whole = denoiser.gather(latent) if denoiser.own == 0 else {}
        record.step_seconds, record.peak_memory_sampling_bytes = step_seconds, peak
        record.timings.update(sampling=sum(step_seconds), gather=watch.seconds)
        record.nvfp4_paths, record.attention_kernels = self.runtime.record.paths(), self.runtime.record.kernels()
        record.fp4_gemm_shapes = self.runtime.record.gemm_shapes()
        record.profile = profiler.result() if profiler is not None else None
        record.cache = denoiser.cache_record()
        record.compile = self._compile_record(compile_seconds, step_seconds)
        return whole

    def _compile_meter(self, told: StepDoneCallback) -> tuple[StepDoneCallback, list[float]]:
        """`told` wrapped so that each step's compile seconds are noted (nothing without `--compile`)."""
        noted: list[float] = []
        if self.compiled is None:
            return told, noted
        compiled, last = self.compiled, [self.compiled.compile_seconds]

        def on_step(step: int, steps: int, seconds: float) -> None:
            noted.append(compiled.compile_seconds - last[0])
            last[0] = compiled.compile_seconds
            told(step, steps, seconds)

        return on_step, noted

    def _compile_record(self, compile_seconds: list[float], step_seconds: list[float]) -> CompileRecord | None:
        if self.compiled is None:
            return None
        return CompileRecord(fullgraph=self.compiled.fullgraph, step_compile_seconds=compile_seconds,
                             step_seconds=[max(0.0, s - c) for s, c in zip(step_seconds, compile_seconds)])


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


def encode_prompts(ctx: RankContext, run: ResolvedRun, runtime: ParallelRuntime, record: RankReport) -> Conditioning:
    """Rank 0 encodes the request's prompts (and keyframes) and releases the encoders; every rank of the
    run gets the `Conditioning` by broadcast. The time, peak memory and (rank 0) the encoder's info go to `record`."""
    dev.reset_peak_memory(ctx.device)
    with dev.Stopwatch(ctx.device) as watch:
        given, info = _encode_on_rank_zero(run, ctx.device) if ctx.rank == 0 else (None, None)
        tensors = broadcast_tensors(given.tensors() if given is not None else None, src=0, group=ctx.group, device=ctx.device, stats=runtime.stats)
    record.timings["text_encode"], record.peak_memory_text_bytes, record.text_encoder = watch.seconds, dev.peak_memory_bytes(ctx.device), info
    return Conditioning.of_tensors(tensors, len(run.request.prompts), run.keyframes is not None)


def _encode_on_rank_zero(run: ResolvedRun, device: torch.device) -> tuple[Conditioning, dict]:
    from h3core.text import release_text_encoder

    (keyframes,) = keyframe_latents([run], device)  # the VAE's encoder first, released before the text encoder loads
    encoder = open_text_encoder(run, device)
    given = encode_request(encoder, run, prepared_images(run))
    info = encoder.info.model_dump(mode="json")
    release_text_encoder(encoder)
    given.keyframes = keyframes
    return given, info


def open_text_encoder(run: ResolvedRun, device: torch.device) -> "TextEncoder":
    """The text encoder `run` names, loaded on `device` in the run's compute dtype."""
    from h3core.text import load_text_encoder

    dtype = dev.compute_dtype(device.type, run.request.dtype)
    return load_text_encoder(run.request.text_encoder_path, hidden_size=run.config.text_dim, seed=0, device=device, dtype=dtype)


def prepared_images(run: ResolvedRun) -> list:
    """The request's keyframes on its canvas, in packed order ([] for t2va)."""
    from h3core.generate.keyframes import prepared_keyframes

    return prepared_keyframes(run.keyframes, (run.shape.width, run.shape.height)) if run.keyframes is not None else []


def encode_request(encoder: "TextEncoder", run: ResolvedRun, images: list | None = None) -> Conditioning:
    """The float32 CPU hidden states of the request's prompts (the prompt's, then the negative prompt's),
    each presented after the keyframe `images` (when given), their row tags checked against the plan."""
    states = []
    for prompt, plan in zip(run.request.prompts, run.plan.sequences):
        rows, tags = encoder.encode_prompt(prompt, images or (), run.config.max_text_tokens)
        check_text_tags(plan, tags.cpu())
        states.append(rows.float().cpu())
    return Conditioning(states)


def keyframe_latents(runs: list[ResolvedRun], device: torch.device) -> list[torch.Tensor | None]:
    """Each run's keyframes' normalized latents `[24, n, H/16, W/16]` (None for t2va), by the video VAE's
    encoder: loaded alone on `device` once per VAE the runs name, released before returning."""
    from h3core.generate.keyframes import encode_keyframe_latents

    out: list[torch.Tensor | None] = [None] * len(runs)
    for vae in dict.fromkeys(run.keyframes.video_vae for run in runs if run.keyframes is not None):
        mine = [i for i, run in enumerate(runs) if run.keyframes is not None and run.keyframes.video_vae == vae]
        plans = [runs[i].keyframes for i in mine]
        images = [prepared_images(runs[i]) for i in mine]
        for i, latents in zip(mine, encode_keyframe_latents(plans, images, device)):  # type: ignore[arg-type]
            out[i] = latents
    return out


def rank_generate(ctx: RankContext, run: ResolvedRun, load=RankPipeline.load) -> RankReport:  # type: ignore[no-untyped-def]
    """The whole run on one rank (module docstring): this rank's report, filled as the run goes;
    `load` builds the pipeline (the baseline passes `RankPipeline.unparallelized`)."""
    record = new_record(ctx)
    runtime = rank_runtime(ctx, run)
    given = encode_prompts(ctx, run, runtime, record)
    pipeline = load(ctx, run, runtime)
    record.timings.update(pipeline.timings)
    whole = pipeline.denoise(run, given, record, ctx.report)
    return finish_record(record, run, pipeline, whole, given.keyframes)


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


def new_record(ctx: RankContext) -> RankReport:
    """The report this rank fills for one request."""
    return RankReport(rank=ctx.rank, cpu_allocator=cpu_memory.policy() if ctx.device.type == "cpu" else "n/a")


def finish_record(record: RankReport, run: ResolvedRun, pipeline: RankPipeline, whole: Latent, keyframes: torch.Tensor | None = None) -> RankReport:
    """The rank's report once its request is done: what it holds, moved and used; the lead of each
    replica (local rank 0 of branch 0) carries the latents (and the keyframes' condition latents)."""
    record.weights, record.comm, record.used = pipeline.weights, pipeline.runtime.stats, pipeline.runtime.used
    if pipeline.runtime.rank == 0 and whole:
        record.carry(*_unpatchified(run, whole), condition=keyframes.cpu() if keyframes is not None else None)
    return record


def _unpatchified(run: ResolvedRun, latent: Latent) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The whole latent as `[24, T, H/16, W/16]` video and `[2, 32, T_a]` audio (None for a kind the run has none of)."""
    shape = run.shape
    video, audio = latent.get(SegmentKind.VIDEO), latent.get(SegmentKind.AUDIO)
    return (
        unpatchify_video(video.cpu(), shape.video_latent, shape.patch) if video is not None else None,
        unpack_audio(audio.cpu()) if audio is not None else None,
    )
