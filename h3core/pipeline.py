"""Text in, video + audio latents out: the denoising loop on every rank, and the run around it.

`generate(request)` is the one call behind `h3 generate`. In the calling process it resolves the
request (preset or checkpoint config, sizes, device, world size), validates the partition
before anything is spawned, builds the synthetic checkpoint if needed, launches the ranks, and
turns their results into a `RunReport` plus files. On every rank, `rank_generate`:

1. rank 0 encodes the prompt (and the negative prompt) and releases the encoder; the hidden
   states reach every rank by broadcast;
2. the model is loaded (tensor mode: only this rank's slices of the per-block linears) and the
   mode is applied from outside (`h3core.parallel`);
3. seeded noise (same on every rank, whatever the world size) is patchified, and the rank keeps
   only its own rows of the packed sequence: the residual stream and the latent state stay
   token-sharded for the whole loop;
4. each step: model -> velocity rows -> float32 Euler update of the rank's rows;
5. at the end the latent rows are gathered once and unpatchified.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from pathlib import Path
from typing import Callable, ClassVar

import torch
from pydantic import BaseModel, ConfigDict, Field

from h3core import cpu_memory
from h3core import device as dev
from h3core import partition
from h3core import attention
from h3core.nvfp4 import matmul as nvfp4_matmul
from h3core.checkpoint import Checkpoint, synthetic_checkpoint, SYNTHETIC
from h3core.collectives import CommStats
from h3core.config import ModelConfig, preset as get_preset
from h3core.errors import ConfigError
from h3core.limits import capacity, check_cpu_ranks, check_memory, generate_need
from h3core.model import (
    H3Model,
    LATENT_KINDS,
    PackedSequence,
    Rope,
    patchify_audio,
    patchify_video,
    rope_table,
    token_positions,
    unpatchify_audio,
    unpatchify_video,
)
from h3core.partition import Segment, SegmentKind, Span
from h3core.parallel.tensor import block_linears, sharded_prefixes
from h3core.plan import Mode, ParallelPlan
from h3core.parity import LatentParity, latent_parity, run_tolerance
from h3core.outputs import FileInFolder, OutputFile, OutputFolder, Outputs
from h3core.preview import preview_png
from h3core.profile import RankProfile, RunProfile, profiling, step_context
from h3core.report import TensorChecksum, Versions, timestamp
from h3core.sampler import FlowMatchEuler, check_finite, guided_velocity, initial_noise
from h3core.validation import UserRequest

DEFAULT_SEED = 440420  # the seed's reference runs
DEFAULT_PROMPT = "a red fox running through fresh snow at dawn, wind and crunching footsteps"
MAX_SEED = 2**64 - 1  # the range of torch.Generator.manual_seed; larger or negative seeds are refused, not wrapped


class GenerateRequest(UserRequest):
    """Everything a run needs, as the user gave it (None = the preset's or the environment's default).

    Built from flags: an invalid value is one ConfigError line naming its flag (`UserRequest`).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")
    FLAGS: ClassVar[dict[str, str]] = {
        "guidance_scale": "--guidance", "world_size": "--gpus", "model_path": "--model", "text_encoder_path": "--text-encoder",
    }

    prompt: str = Field(DEFAULT_PROMPT, description="What to generate.")
    negative_prompt: str = Field("", description="Guidance's unconditional prompt (used when guidance_scale != 1).")
    guidance_scale: float = Field(1.0, ge=0, allow_inf_nan=False, description="Classifier-free guidance; 1 runs one forward per step.")
    preset: str | None = Field(None, description="Model preset; default tiny without a checkpoint, h3 with one.")
    width: int | None = Field(None, ge=1, description="Pixels (default: the preset's).")
    height: int | None = Field(None, ge=1, description="Pixels (default: the preset's).")
    frames: int | None = Field(None, ge=1, description="Video frames, 4k+1 (default: the preset's).")
    steps: int | None = Field(None, ge=1)
    seed: int = Field(DEFAULT_SEED, ge=0, le=MAX_SEED)
    shift: float | None = Field(None, gt=0, allow_inf_nan=False, description="Sampler sigma shift (default: the preset's).")
    mode: Mode = Mode.ULYSSES
    world_size: int = Field(1, ge=1)
    device: str = Field("cpu", description="'cpu' or 'cuda' (resolved).")
    dtype: str | None = Field(None, description="Compute dtype override: fp32, bf16, fp16.")
    attention: str = "sdpa"
    model_path: Path | None = None
    text_encoder_path: Path | None = None
    profile: bool = Field(False, description="Split every step's time per rank: attention, NVFP4 linears, each collective, the rest (h3core.profile).")


class RunShape(BaseModel):
    """The resolved geometry of a run (what every rank agrees on before spawning)."""

    model_config = ConfigDict(frozen=True)
    width: int
    height: int
    frames: int
    steps: int
    shift: float
    video_latent: tuple[int, int, int, int]
    audio_latent: tuple[int, int]
    video_grid: tuple[int, int, int]


class ResolvedRun(BaseModel):
    """A request resolved against its checkpoint: what the ranks execute."""

    model_config = ConfigDict(frozen=True)
    request: GenerateRequest
    config: ModelConfig
    checkpoint: Path
    synthetic: bool
    shape: RunShape


def _given(value, default):
    return default if value is None else value


def resolve(request: GenerateRequest) -> ResolvedRun:
    """Pick the config (checkpoint wins over preset), sizes and checkpoint; validate before spawning.

    Cheap checks run first (sizes, backend, text encoder headers, the partition of the real
    prompts' sequences, the memory every rank needs); the synthetic checkpoint is built last, so a
    bad request fails in well under a second and allocates nothing.
    """
    from h3core.text import check_text_encoder

    base = get_preset(request.preset or ("h3" if request.model_path else "tiny"))
    ckpt = Checkpoint.open(request.model_path, base) if request.model_path is not None else None
    config = ckpt.config if ckpt else base
    width, height = _given(request.width, config.width), _given(request.height, config.height)
    frames, steps = _given(request.frames, config.frames), _given(request.steps, config.steps)
    shape = RunShape(
        width=width, height=height, frames=frames, steps=steps, shift=_given(request.shift, config.shift),
        video_latent=config.video_latent_shape(width, height, frames),
        audio_latent=config.audio_latent_shape(frames),
        video_grid=config.video_grid(width, height, frames),
    )
    attention.check_backend(request.attention, request.device, head_dim=config.head_dim, dtype=dev.compute_dtype(request.device, request.dtype))
    nvfp4_matmul.emulate_fp4_from_env()  # a malformed H3_EMULATE_FP4 fails here, before any rank starts
    # The partition of every sequence the ranks will run, from the prompts' real token counts
    # (the tokenizer is cheap; rank 0 gets the same counts when it encodes them).
    tokenizer = check_text_encoder(request.text_encoder_path, hidden_size=config.text_dim)
    prompts = [request.prompt] + ([request.negative_prompt] if request.guidance_scale != 1.0 else [])
    lengths = [min(len(tokenizer.encode(p)), config.max_text_tokens) for p in prompts]
    plans = [ParallelPlan.build(config, request.world_size, request.mode, config.segments(width, height, frames, n)) for n in lengths]
    _check_limits(request, config, shape, plans)
    if ckpt is not None:
        ckpt.validate()
        path, synthetic = request.model_path, ckpt.weights == SYNTHETIC
    else:
        path, synthetic = synthetic_checkpoint(base, seed=0)[0], True
    return ResolvedRun(request=request, config=config, checkpoint=Path(path), synthetic=synthetic, shape=shape)


def _check_limits(request: GenerateRequest, config: ModelConfig, shape: RunShape, plans: list[ParallelPlan]) -> None:
    """Refuse (one line) a run whose ranks this machine cannot start or hold (`h3core.limits`)."""
    from h3core.launch import under_torchrun

    if request.device != "cuda" and not under_torchrun():
        check_cpu_ranks(request.world_size)

    elements = math.prod(shape.video_latent) + math.prod(shape.audio_latent)
    dtype = dev.compute_dtype(request.device, request.dtype)
    spawned = request.world_size > 1 and not under_torchrun()
    need = generate_need(config, plans, elements, shape.steps, request.device, dtype, request.attention, spawned)
    check_memory(need, capacity(request.device, request.world_size), "--width/--height/--frames")


# --- the loop on one rank --------------------------------------------------------------------------


class Sequence(BaseModel):
    """One packed sequence of a run (the prompt's, or guidance's negative prompt's)."""

    model_config = ConfigDict(arbitrary_types_allowed=True)
    segments: list[Segment]
    text: torch.Tensor  # [L, text_dim]


def build_sequence(config: ModelConfig, shape: RunShape, text: torch.Tensor) -> Sequence:
    segments = config.segments(shape.width, shape.height, shape.frames, text.shape[0])
    return Sequence(segments=segments, text=text)


def noise_tokens(config: ModelConfig, shape: RunShape, seed: int) -> dict[SegmentKind, torch.Tensor]:
    """Seeded noise as patch tokens: {video: [Nv, Pv], audio: [Na, Pa]}, float32, identical on every rank."""
    noise = initial_noise(seed, {"video": shape.video_latent, "audio": shape.audio_latent})
    return {
        SegmentKind.VIDEO: patchify_video(noise["video"], config.video_patch),
        SegmentKind.AUDIO: patchify_audio(noise["audio"], config.audio_patch),
    }


class StepDone(BaseModel):
    """Progress message rank 0 sends after each denoising step."""

    step: int
    steps: int
    seconds: float


StepCallback = Callable[[StepDone], None]


class WeightBytes(BaseModel):
    """Weight memory of one rank: the per-block linears tensor mode shards, and everything else."""

    resident: int = Field(description="Bytes of every parameter and buffer the rank holds.")
    read: int = Field(description="Bytes this rank read from the checkpoint.")
    block_linears_resident: int = Field(description="Held bytes of the blocks' QKV/Out/FC1/FC2 (with their biases).")
    block_linears_read: int = Field(description="Bytes of those linears read from disk.")
    block_linears_full: int = Field(description="Their size in the checkpoint: what one unsharded rank holds.")

    @property
    def block_share(self) -> float:
        """Held fraction of the full block linears (tensor mode at N ranks: about 1/N)."""
        return self.block_linears_resident / self.block_linears_full if self.block_linears_full else 1.0


class RankOutcome(BaseModel):
    """What one rank reports back to the launching process."""

    model_config = ConfigDict(arbitrary_types_allowed=True)
    rank: int
    timings: dict[str, float]
    step_seconds: list[float]
    peak_memory_text: int
    peak_memory_sampling: int
    weights: WeightBytes
    comm: CommStats
    nvfp4_paths: dict[str, int]  # NVFP4 matmul path -> forward calls in the denoising loop (what ran)
    attention_kernels: dict[str, int]  # attention kernel -> calls in the denoising loop (what ran)
    cpu_allocator: str = "n/a"  # h3core.cpu_memory policy of this rank (CPU runs)
    profile: RankProfile | None = None  # with request.profile
    plan: ParallelPlan | None = None  # rank 0: the partition actually used (after tokenizing)
    text_encoder: dict | None = None  # rank 0
    video: torch.Tensor | None = None  # rank 0: [C, T, H, W] float32
    audio: torch.Tensor | None = None  # rank 0: [C, L] float32

    @property
    def latents(self) -> dict[str, torch.Tensor | None]:
        return {"video": self.video, "audio": self.audio}


def _load_model(run: ResolvedRun, runtime, device: torch.device, dtype: torch.dtype, distributed: bool = True) -> tuple[H3Model, Checkpoint, int]:
    """Load the model for this rank and apply the mode; tensor mode reads only this rank's slices.

    `distributed=False` (one rank only) loads the plain model with no mode applied: the baseline
    that measures what the distributed layer costs at world size 1.
    """
    from h3core.parallel import CheckpointWeights, apply_tensor, apply_ulysses

    ckpt = Checkpoint.open(run.checkpoint, run.config)
    tensor_mode = run.request.mode is Mode.TENSOR and distributed
    skip = sharded_prefixes(run.config.num_blocks) if tensor_mode else ()
    model = ckpt.load(device=device, dtype=dtype, skip=skip)
    for block in model.blocks:
        block.attn.core.backend = run.request.attention
    if not tensor_mode:
        if distributed:
            apply_ulysses(model, runtime)
        return model, ckpt, ckpt.bytes_under(sharded_prefixes(run.config.num_blocks))
    before = ckpt.reader.bytes_read
    apply_tensor(model, runtime, CheckpointWeights(ckpt, device, dtype))
    return model, ckpt, ckpt.reader.bytes_read - before


def _encode_prompts(run: ResolvedRun, device: torch.device, dtype: torch.dtype) -> tuple[list[torch.Tensor], dict]:
    """Rank 0: prompt (and negative prompt) -> text hidden states; the encoder is released after."""
    from h3core.text import load_text_encoder, release_text_encoder

    req, cfg = run.request, run.config
    encoder = load_text_encoder(req.text_encoder_path, hidden_size=cfg.text_dim, seed=0, device=device, dtype=dtype)
    prompts = [req.prompt] + ([req.negative_prompt] if req.guidance_scale != 1.0 else [])
    texts = [encoder.encode(p, cfg.max_text_tokens).float().cpu() for p in prompts]
    info = encoder.info.model_dump(mode="json")
    release_text_encoder(encoder)
    return texts, info


def local_inputs(seq: Sequence, rows: Span, latent: dict[SegmentKind, torch.Tensor], rope: Rope) -> PackedSequence:
    """The model input for `rows` of `seq`: its text rows, the given latent rows, the RoPE table."""
    features = dict(latent)
    text = partition.kind_rows(seq.segments, rows).get(SegmentKind.TEXT)
    if text is not None:
        features[SegmentKind.TEXT] = seq.text[text.start : text.stop]
    return PackedSequence(segments=partition.clip_segments(seq.segments, rows), features=features, rope=rope.select(rows))


def rank_generate(ctx, run: ResolvedRun, distributed: bool = True) -> RankOutcome:
    """The whole run on one rank (every rank calls this; world size 1 is the same code).

    `distributed=False` runs the plain model (no mode applied) and needs world size 1.
    """
    from h3core.collectives import broadcast_tensors, repartition_rows
    from h3core.launch import maybe_inject_fault
    from h3core.parallel import ParallelRuntime

    req, cfg, shape = run.request, run.config, run.shape
    device, dtype = ctx.device, dev.compute_dtype(ctx.device.type, req.dtype)
    runtime = ParallelRuntime(ctx.group, ctx.rank, ctx.world_size, cfg.num_heads)
    timings: dict[str, float] = {}

    # 1. Text: encoded once on rank 0, released, broadcast to every rank.
    dev.reset_peak_memory(device)
    with dev.Stopwatch(device) as watch:
        texts, encoder_info = _encode_prompts(run, device, dtype) if ctx.rank == 0 else (None, None)
        texts = broadcast_tensors(texts, src=0, group=ctx.group, device=device, stats=runtime.stats)
    timings["text_encode"] = watch.seconds
    peak_text = dev.peak_memory_bytes(device)

    # 2. The model, sharded for the mode (tensor mode reads only this rank's slices).
    with dev.Stopwatch(device) as watch:
        if not distributed and ctx.world_size != 1:
            raise ValueError("the plain (non-distributed) pipeline runs on one rank only")
        model, ckpt, block_read = _load_model(run, runtime, device, dtype, distributed)
    timings["load"] = watch.seconds
    weights = WeightBytes(
        resident=dev.resident_bytes(model),
        read=ckpt.reader.bytes_read,
        block_linears_resident=sum(dev.resident_bytes(m) for m in block_linears(model)),
        block_linears_read=block_read,
        block_linears_full=ckpt.bytes_under(sharded_prefixes(cfg.num_blocks)),
    )

    # 3. The prompt's sequence (and the negative prompt's), split over ranks; this rank's noise rows.
    sequences = [build_sequence(cfg, shape, t.to(device)) for t in texts]
    plans = [ParallelPlan.build(cfg, ctx.world_size, req.mode, s.segments) for s in sequences]
    spans = [[r.tokens.span for r in p.ranks] for p in plans]
    ropes = [rope_table(cfg, token_positions(s.segments, shape.video_grid)).to(device) for s in sequences]
    noise = noise_tokens(cfg, shape, req.seed)
    kinds = [k for k in LATENT_KINDS if any(seg.kind is k for seg in sequences[0].segments)]
    own = {k: partition.kind_spans(sequences[0].segments, spans[0], k) for k in kinds}  # per kind, per rank
    state = {k: noise[k][own[k][ctx.rank].start : own[k][ctx.rank].stop].to(device) for k in kinds}  # float32

    def velocity(index: int, latent: dict[SegmentKind, torch.Tensor], sigma: torch.Tensor) -> dict[SegmentKind, torch.Tensor]:
        rows = spans[index][ctx.rank]
        with runtime.sequence(spans[index]):
            out = model(local_inputs(sequences[index], rows, latent, ropes[index]), sigma)
        return {k: out.get(k, latent[k][:0].to(dtype)) for k in kinds}

    def moved(latent: dict[SegmentKind, torch.Tensor], src: int, dst: int) -> dict[SegmentKind, torch.Tensor]:
        """Latent rows re-split from sequence `src`'s partition to sequence `dst`'s (prompt lengths differ)."""
        return {
            k: repartition_rows(
                latent[k],
                partition.kind_spans(sequences[src].segments, spans[src], k),
                partition.kind_spans(sequences[dst].segments, spans[dst], k),
                ctx.group,
                runtime.stats,
            )
            for k in kinds
        }

    # 4. Denoise: velocity of this rank's rows, float32 Euler update of the same rows.
    sampler = FlowMatchEuler(shape.shift)
    sigmas = sampler.set_timesteps(shape.steps)
    dev.reset_peak_memory(device)
    attention.reset_kernel_record()
    nvfp4_matmul.reset_path_record()
    step_seconds = []
    with torch.inference_mode(), profiling(model, device, ctx.rank, req.profile) as profiler:
        for i, sigma in enumerate(sigmas):
            maybe_inject_fault("step", ctx.rank, index=i)
            with dev.Stopwatch(device) as watch, step_context(profiler):
                sigma_t = sigma.to(device)
                v = velocity(0, state, sigma_t)
                if len(sequences) > 1:
                    v_neg = moved(velocity(1, moved(state, 0, 1), sigma_t), 1, 0)
                    v = {k: guided_velocity(v[k], v_neg[k], req.guidance_scale) for k in kinds}
                state = {k: sampler.step(v[k], i, state[k]) for k in kinds}
            step_seconds.append(watch.seconds)
            check_finite({k.value: x for k, x in state.items()}, step=i + 1, steps=len(sigmas))
            ctx.report(StepDone(step=i + 1, steps=len(sigmas), seconds=watch.seconds))
        timings["sampling"] = sum(step_seconds)
        peak_sampling = dev.peak_memory_bytes(device)

        # 5. Latents gathered once, then unpatchified on rank 0.
        with dev.Stopwatch(device) as watch:
            full = {k: runtime.gather(state[k], own[k]) for k in kinds}
        timings["gather"] = watch.seconds

    outcome = RankOutcome(
        rank=ctx.rank,
        timings=timings,
        step_seconds=step_seconds,
        peak_memory_text=peak_text,
        peak_memory_sampling=peak_sampling,
        weights=weights,
        comm=runtime.stats,
        nvfp4_paths=nvfp4_matmul.paths_run(),
        attention_kernels=attention.kernels_run(),
        cpu_allocator=cpu_memory.policy() if device.type == "cpu" else "n/a",
        profile=profiler.result() if profiler is not None else None,
    )
    if ctx.rank == 0:
        outcome.plan = plans[0]
        outcome.text_encoder = encoder_info
        if SegmentKind.VIDEO in full:
            outcome.video = unpatchify_video(full[SegmentKind.VIDEO].cpu(), shape.video_latent, cfg.video_patch)
        if SegmentKind.AUDIO in full:
            outcome.audio = unpatchify_audio(full[SegmentKind.AUDIO].cpu(), shape.audio_latent, cfg.audio_patch)
    return outcome


# --- the run around the ranks ----------------------------------------------------------------------


class RankStats(BaseModel):
    rank: int
    peak_memory_text_bytes: int
    peak_memory_sampling_bytes: int
    weights: WeightBytes
    comm: CommStats
    sampling_seconds: float
    nvfp4_paths: dict[str, int] = Field(default_factory=dict, description="NVFP4 matmul path -> forward calls this rank ran in the denoising loop.")
    attention_kernels: dict[str, int] = Field(default_factory=dict, description="Attention kernel -> calls this rank ran in the denoising loop.")


class RunFiles(BaseModel):
    directory: str
    report: str
    latents: str | None
    preview: str | None
    benchmark: str | None = None


class RunReport(BaseModel):
    """Everything about one `h3 generate` run (DESIGN.md §6)."""

    command: str = "generate"
    created: str
    mode: Mode
    world_size: int
    device: str
    device_name: str
    ranks_on: str  # e.g. "6 CPU ranks (Gloo)" or "8 GPUs (NCCL)"
    dist_backend: str
    dtype: str
    attention: str
    attention_kernel: str  # the kernels every rank ran (per rank where they differ); see ranks[].attention_kernels
    nvfp4_path: str  # the NVFP4 paths every rank ran (per rank where they differ); see ranks[].nvfp4_paths
    weights: str  # "synthetic", or the checkpoint path and its size
    checkpoint: str
    config: ModelConfig
    text_encoder: dict
    prompt: str
    negative_prompt: str
    guidance_scale: float
    seed: int
    shape: RunShape
    num_tokens: int
    partition: ParallelPlan
    timings: dict[str, float]  # per phase, the slowest rank
    step_seconds: list[float]  # per step, the slowest rank
    ranks: list[RankStats]
    comm_total: CommStats
    video: TensorChecksum | None
    audio: TensorChecksum | None
    parity: LatentParity | None = None  # with --parity: vs the single-rank run (at 1 rank: vs the other mode)
    cpu_allocator: str = "n/a"  # CPU runs: the ranks' allocator policy (h3core.cpu_memory)
    profile: RunProfile | None = None  # with --profile: per rank and step, where the time went
    files: RunFiles | None = None
    versions: Versions


def _ranks_on(world_size: int, device: str) -> str:
    return f"{world_size} GPU{'s' if world_size > 1 else ''} (NCCL)" if device == "cuda" else f"{world_size} CPU rank{'s' if world_size > 1 else ''} (Gloo)" if world_size > 1 else "1 CPU process"


def build_report(run: ResolvedRun, outcomes: list[RankOutcome]) -> RunReport:
    req, first = run.request, outcomes[0]
    phases = sorted({k for o in outcomes for k in o.timings})
    steps = len(first.step_seconds)
    dtype = dev.compute_dtype(req.device, req.dtype)
    return RunReport(
        created=timestamp(),
        mode=req.mode,
        world_size=req.world_size,
        device=req.device,
        device_name=dev.device_name(req.device),
        ranks_on=_ranks_on(req.world_size, req.device),
        dist_backend="none" if req.world_size == 1 else ("nccl" if req.device == "cuda" else "gloo"),
        dtype=dev.dtype_name(dtype),
        attention=req.attention,
        attention_kernel=per_rank_summary([o.attention_kernels for o in outcomes]),
        nvfp4_path=per_rank_summary([o.nvfp4_paths for o in outcomes]),
        weights=SYNTHETIC if run.synthetic else f"{run.checkpoint} ({run.checkpoint.stat().st_size:,} bytes)",
        checkpoint=str(run.checkpoint),
        config=run.config,
        text_encoder=first.text_encoder or {},
        prompt=req.prompt,
        negative_prompt=req.negative_prompt,
        guidance_scale=req.guidance_scale,
        seed=req.seed,
        shape=run.shape,
        num_tokens=first.plan.num_tokens,
        partition=first.plan,
        timings={p: max(o.timings.get(p, 0.0) for o in outcomes) for p in phases},
        step_seconds=[max(o.step_seconds[i] for o in outcomes) for i in range(steps)],
        ranks=[
            RankStats(
                rank=o.rank,
                peak_memory_text_bytes=o.peak_memory_text,
                peak_memory_sampling_bytes=o.peak_memory_sampling,
                weights=o.weights,
                comm=o.comm,
                sampling_seconds=o.timings.get("sampling", 0.0),
                nvfp4_paths=o.nvfp4_paths,
                attention_kernels=o.attention_kernels,
            )
            for o in outcomes
        ],
        comm_total=CommStats.total(o.comm for o in outcomes),
        video=TensorChecksum.of(first.video) if first.video is not None else None,
        audio=TensorChecksum.of(first.audio) if first.audio is not None else None,
        cpu_allocator=first.cpu_allocator,
        profile=RunProfile.of([o.profile for o in outcomes]) if all(o.profile for o in outcomes) else None,
        versions=Versions.collect(),
    )


def per_rank_summary(records: list[dict[str, int]]) -> str:
    """What ranks ran: 'a + b' when every rank ran the same set, else one 'rank r: ...' entry per rank."""
    names = [" + ".join(sorted(record)) or "none" for record in records]
    if len(set(names)) == 1:
        return names[0]
    return "; ".join(f"rank {rank}: {name}" for rank, name in enumerate(names))


def write_outputs(
    report: RunReport, outcome: RankOutcome, folder: OutputFolder, save_latents: bool, benchmark: OutputFile | FileInFolder | None, under: str = ""
) -> RunFiles:
    """Stage the latents (unless not saved), a preview PNG and the report in `folder` (in its
    subfolder `under`), and the report copy in `benchmark`; they appear when the caller publishes
    them (`h3core.outputs`). The report names the paths the files will have."""
    from safetensors.torch import save as save_tensors

    def place(name: str) -> str:
        return str(Path(under) / name) if under else name

    latents = None
    if save_latents:
        tensors = {k: t.contiguous() for k, t in (("video", outcome.video), ("audio", outcome.audio)) if t is not None}
        latents = folder.write(place("latents.safetensors"), save_tensors(tensors, metadata={"seed": str(report.seed)}))
    preview = None
    if outcome.video is not None:
        title = f"h3 {report.mode.value} x{report.world_size} · seed {report.seed} · weights: {report.weights}"
        preview = folder.write(place("preview.png"), preview_png(outcome.video, title))
    files = RunFiles(
        directory=str(folder.path / under if under else folder.path),
        report=str(folder.path / place("report.json")),
        latents=str(latents) if latents else None,
        preview=str(preview) if preview else None,
        benchmark=str(benchmark.path) if benchmark else None,
    )
    report.files = files
    data = (report.model_dump_json(indent=2) + "\n").encode()
    if benchmark is not None:
        benchmark.write(data)
    folder.write(place("report.json"), data)
    return files


def output_bytes(run: ResolvedRun, save_latents: bool) -> int:
    """What a run writes, for the free-space check: the float32 latents when saved (report and
    preview fit in the outputs' margin)."""
    return 4 * (math.prod(run.shape.video_latent) + math.prod(run.shape.audio_latent)) if save_latents else 0


def one_rank_latents(
    run: ResolvedRun, *, mode: Mode | None = None, threads: int | None = None, on_step: StepCallback | None = None
) -> dict[str, torch.Tensor | None]:
    """`run` on one rank in this process (in `mode` if given), at `threads` CPU intra-op threads.

    The reference every parity figure is measured against. On the CPU pass the compared ranks'
    thread count: kernels block by thread count, and the comparison is meant to isolate the
    distribution, not the machine's threading.
    """
    update = {"world_size": 1} | ({"mode": mode} if mode is not None else {})
    one = run.model_copy(update={"request": run.request.model_copy(update=update)})
    with dev.cpu_threads(threads) if threads else nullcontext():
        (outcome,) = execute(one, on_step)
    return outcome.latents


def reference_parity(run: ResolvedRun, outcome: RankOutcome) -> LatentParity:
    """Compare with the single-rank reference (at one rank: the other mode, the identity path)."""
    req = run.request
    other = Mode.TENSOR if req.mode is Mode.ULYSSES else Mode.ULYSSES
    mode = other if req.world_size == 1 else req.mode
    name = f"1 rank, {mode.value} mode" + (" (the identity path)" if req.world_size == 1 else "")
    threads = dev.cpu_threads_per_rank(req.world_size) if req.device == "cpu" else None
    reference = one_rank_latents(run, mode=mode, threads=threads)
    tol = run_tolerance(req.mode, dev.compute_dtype(req.device, req.dtype), outcome.nvfp4_paths)
    return latent_parity(outcome.latents, reference, tol, name)


def execute(run: ResolvedRun, on_step: StepCallback | None = None) -> list[RankOutcome] | None:
    """Run every rank of `run` in a fresh World; rank 0's outcome (first) carries the latents.

    Under torchrun every process calls this; only rank 0 gets the outcomes, the others None.
    """
    from h3core.launch import World

    with World(run.request.world_size, run.request.device, on_progress=on_step) as world:
        try:
            outcomes = world.run(rank_generate, run)
        finally:
            if run.request.world_size == 1:  # it ran in this process: nothing of it may stay on a device
                dev.release_memory(run.request.device)
        return outcomes if world.is_main else None


def generate(
    request: GenerateRequest,
    *,
    output: Path | None = None,
    save_latents: bool = True,
    benchmark: Path | None = None,
    parity: bool = False,
    overwrite: bool = False,
    on_step: StepCallback | None = None,
) -> RunReport | None:
    """Resolve, reserve the output folder, launch every rank, and publish the report with its files
    (only after every rank succeeded; on any failure or Ctrl-C nothing is written).

    Returns None on the ranks of a torchrun launch other than rank 0 (which writes everything).
    """
    from h3core.environment import torchrun_env

    if parity and torchrun_env() is not None:
        raise ConfigError("--parity runs a one-rank reference in the launching process; run it without torchrun, or use `h3 verify parity`")
    run = resolve(request)
    launched = torchrun_env()
    with Outputs(enabled=launched is None or launched.rank == 0) as outputs:
        folder = bench = None
        if outputs.enabled:
            kind = f"generate-{request.mode.value}-{request.world_size}"
            folder = outputs.folder(output, kind=kind, need_bytes=output_bytes(run, save_latents), overwrite=overwrite)
            bench = outputs.file(benchmark, flag="--benchmark") if benchmark is not None else None
        outcomes = execute(run, on_step)
        if outcomes is None or folder is None:
            return None
        report = build_report(run, outcomes)
        if parity:
            report.parity = reference_parity(run, outcomes[0])
        write_outputs(report, outcomes[0], folder, save_latents, bench)
        outputs.publish()
    return report
