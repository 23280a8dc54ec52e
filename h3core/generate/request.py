"""What `h3 generate` was asked, and `resolve`: everything decided and checked before a rank starts.

`resolve(request)` picks the config (a checkpoint's own config wins over the preset), the
keyframes and the canvas (`h3core.generate.keyframes`: each image checked, the canvas from the
flags, else the first keyframe's aspect, else the preset), the sizes, the device's attention
backend, builds the run's `ParallelPlan` from the prompts' real token counts (the tokenizer is
cheap; with keyframes the prompt as the text encoder presents it, vision blocks and tags included;
rank 0 gets the same counts when it encodes them), checks what every rank needs against this
machine, and builds the synthetic checkpoint if needed, last: a bad request fails in well under a
second and allocates nothing. The `ResolvedRun` goes to every rank.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_core import PydanticCustomError

from h3core import settings
from h3core.errors import AdapterError, ConfigError
from h3core.generate.keyframes import Canvas, KeyframePlan, keyframe_roles, keyframe_vae, open_keyframes, presented_tags, resolve_canvas
from h3core.generate.memory import MemoryCheck, check_encode_memory, check_limits, plan_decoded_weights
from h3core.generate.prompt import PromptText
from h3core.lora.plan import AdapterRecord, adapter_bytes_per_rank, adapter_records, adapters_schedule, open_adapters
from h3core.lora.schedule import AdapterSchedule
from h3core.lora.spec import LoraSpec
from h3core.model.checkpoint import SYNTHETIC, Checkpoint
from h3core.model.config import ModelConfig, VideoShape, preset as get_preset
from h3core.model.sampler import NoiseRecipe
from h3core.nvfp4.selftest import FP4SelfTest
from h3core.parallel.layout import RankLayout
from h3core.parallel.modes import Mode
from h3core.parallel.plan import ParallelPlan
from h3core.runtime.device import compute_dtype, dtype_key
from h3core.settings import UserRequest

DEFAULT_PROMPT = "a red fox running through fresh snow at dawn, wind and crunching footsteps"
MAX_SEED = 2**64 - 1  # the range of torch.Generator.manual_seed; larger or negative seeds are refused, not wrapped


class GenerateRequest(UserRequest):
    """Everything a run needs, as the user gave it (None = the preset's or the environment's default).

    Built from flags: an invalid value is one ConfigError line naming its flag (`UserRequest`).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")
    FLAGS: ClassVar[dict[str, str]] = {
        "guidance_scale": "--guidance", "world_size": "--gpus", "model_path": "--model", "text_encoder_path": "--text-encoder",
        "cfg_parallel": "--cfg-parallel", "decoded_weights": "--decoded-weights", "keyframes": "--keyframe", "loras": "--lora",
        "cache": "--cache", "ulysses_overlap": "--ulysses-overlap", "compile": "--compile",
    }

    prompt: PromptText = Field(DEFAULT_PROMPT, description="What to generate (not empty or blank: `h3core.generate.prompt`).")
    negative_prompt: str = Field("", description="Guidance's unconditional prompt (used when guidance_scale != 1).")
    guidance_scale: float = Field(1.0, ge=0, allow_inf_nan=False, description="Classifier-free guidance; 1 runs one forward per step.")
    preset: str | None = Field(None, description="Model preset; default tiny without a checkpoint, h3 with one.")
    width: int | None = Field(None, ge=1, description="Pixels (default: the preset's).")
    height: int | None = Field(None, ge=1, description="Pixels (default: the preset's).")
    frames: int | None = Field(None, ge=1, description="Video frames; snapped up to the next 17n + 5 (default: the preset's).")
    steps: int | None = Field(None, ge=2, description="Sigma points of the schedule, terminal 0 included: steps - 1 forwards (default: the preset's; H3's official 50).")
    seed: int = Field(settings.DEFAULT_SEED, ge=0, le=MAX_SEED)
    video_shift: float | None = Field(None, gt=0, allow_inf_nan=False, description="Flow shift of the video schedule (default: the preset's, 12).")
    audio_shift: float | None = Field(None, gt=0, allow_inf_nan=False, description="Flow shift of the audio schedule (default: the preset's, 3).")
    mode: Mode = Mode.ULYSSES
    world_size: int = Field(1, ge=1, description="Every rank of the run: replicas x CFG halves x ranks per sequence.")
    cfg_parallel: bool = Field(False, description="With guidance: half the ranks run the prompt's sequence, half the negative prompt's; one exchange per step.")
    replicas: int = Field(1, ge=1, description="Independent groups of ranks, each running the whole request (h3core.parallel.layout).")
    device: str = Field("cpu", description="'cpu' or 'cuda' once resolved; as the flags give it (auto, cpu, cuda) until a job or matrix resolves it.")
    dtype: str | None = Field(None, description="Compute dtype override: fp32, bf16, fp16 (torch's float32, bfloat16, float16 too; kept as h3's name).")
    attention: str = "sdpa"
    model_path: Path | None = None
    text_encoder_path: Path | None = None
    profile: bool = Field(False, description="Split every step's time per rank: attention, NVFP4 linears, each collective, the rest (h3core.generate.profile).")
    decoded_weights: Literal["auto", "on", "off"] = Field("auto", description="Hold the NVFP4 linears decoded once where they decode every forward (Hopper, the CPU): auto where they fit (h3core.parallel.decoded).")
    keyframes: dict[Literal["first", "last"], Path] = Field(default_factory=dict, description="FL2VA: the image the video starts on (first) and/or ends on (last).")
    loras: tuple[LoraSpec, ...] = Field((), description="LoRA adapters, each beside the linears it adapts at its scale (h3core.lora; docs/lora.md).")
    noise_recipe: NoiseRecipe = Field(NoiseRecipe.OFFICIAL, description="Whose noise the seed means: the official server's (default) or diffusers' (h3core.model.sampler).")
    cache: str = Field("off", description="The step cache: off, or fbcache:THRESHOLD (h3core.model.step_cache; 0 never skips).")
    ulysses_overlap: Literal["auto", "on", "off"] = Field("auto", description="Ulysses' all-to-alls in head groups overlapped with attention: auto where measured faster (h3core.parallel.overlap).")
    compile: bool = Field(False, description="torch.compile the repeated transformer block, collectives outside the compiled pieces (h3core.model.compiled).")

    @field_validator("cache")
    @classmethod
    def _cache(cls, value: str) -> str:
        from h3core.model.step_cache import CachePolicy

        try:
            return str(CachePolicy.parse(value))
        except ValueError as err:
            raise PydanticCustomError("cache", str(err)) from None

    @field_validator("dtype")
    @classmethod
    def _dtype(cls, value: str | None) -> str | None:
        try:
            return None if value is None else dtype_key(value)
        except ValueError as err:
            raise PydanticCustomError("dtype", str(err)) from None

    @property
    def prompts(self) -> list[str]:
        """The prompts the run encodes: the prompt and, with guidance, the negative prompt."""
        return [self.prompt] + ([self.negative_prompt] if self.guidance_scale != 1.0 else [])

    @property
    def keyframe_roles(self) -> tuple[str, ...]:
        """The keyframes' anchors in packed order (first, then last); () for t2va."""
        return keyframe_roles(self.keyframes)  # type: ignore[arg-type]


class GenerateJob(BaseModel):
    """One `h3 generate` command: the request and where its results go (flag > variable > default applied)."""

    model_config = ConfigDict(frozen=True)
    request: GenerateRequest
    output: Path | None = Field(None, description="Report/latent folder (None: outputs/<time>-generate-<mode>-<N>-<4 hex>).")
    save_latents: bool = Field(True, description="Write latents.safetensors (H3_SAVE_LATENTS=0: the report only).")
    benchmark: Path | None = Field(None, description="Also write the report JSON here (H3_DISTRIBUTED_BENCHMARK).")
    parity: bool = Field(False, description="Also run one rank and record the latent error against the derived bound.")
    overwrite: bool = Field(False, description="Replace an existing folder of h3 results at `output` whole.")
    decode: bool = Field(True, description="Decode the latents into video.mp4 once the ranks are done (--no-decode: latents only, `h3 decode` later).")
    video_vae: Path | None = Field(None, description="--video-vae (else H3_VIDEO_VAE_PATH, beside the transformer, the synthetic VAE for a synthetic transformer).")
    audio_vae: Path | None = Field(None, description="--audio-vae (else H3_AUDIO_VAE_PATH, beside the transformer, the synthetic VAE for a synthetic transformer).")

    @classmethod
    def from_flags(cls, flags: GenerateRequest, *, count: int | None, output: Path | None = None, save_latents: bool | None = None,
                   benchmark: Path | None = None, parity: bool = False, overwrite: bool = False, decode: bool = True,
                   video_vae: Path | None = None, audio_vae: Path | None = None) -> "GenerateJob":
        """The job of the command line: `flags` as typed (`device` as given: auto, cpu or cuda), the
        device resolved, the rank count (COUNT/--gpus, else H3_WORLD_SIZE, else every visible GPU,
        else 1) checked against it, every variable applied."""
        from h3core.runtime.device import check_world_size_fits, resolve_device, visible_gpu_count

        device_type = resolve_device(flags.device)
        world = settings.world_size(count, visible_gpu_count)
        check_world_size_fits(world, device_type)
        return cls(
            request=flags.model_copy(update={
                "world_size": world, "device": device_type,
                "model_path": settings.model_path(flags.model_path), "text_encoder_path": settings.text_encoder_path(flags.text_encoder_path),
            }),
            output=settings.output_folder(output), save_latents=settings.save_latents(save_latents),
            benchmark=settings.benchmark_path(benchmark), parity=parity, overwrite=overwrite,
            decode=decode, video_vae=video_vae, audio_vae=audio_vae,
        )


class RunShape(VideoShape):
    """The resolved geometry and schedules of a run (what every rank agrees on before spawning)."""

    model_config = ConfigDict(frozen=True)
    steps: int = Field(description="Sigma points of each schedule, terminal 0 included (steps - 1 forwards).")
    video_shift: float
    audio_shift: float
    video_sigmas: list[float] | None = Field(None, description="An explicit video schedule (an adapter's own), instead of the shifted one.")
    audio_sigmas: list[float] | None = Field(None, description="An explicit audio schedule (an adapter's own), instead of the shifted one.")
    schedule_source: str = Field("", description="Whose schedule this is: '' (the request's and the preset's) or the adapter(s) whose metadata set it.")

    @classmethod
    def of(cls, config: ModelConfig, request: GenerateRequest, canvas: Canvas | None = None,
           schedule: AdapterSchedule | None = None) -> "RunShape":  # type: ignore[override]
        """The request's sizes (the `canvas` when given: the keyframes' one), the config's where the request
        gives none; raises on sizes the VAE cannot take. `schedule`: what the run's adapters ask for
        (h3core.lora.schedule), taken where the request gives nothing; a request value that contradicts
        it is refused."""
        width, height = (canvas.width, canvas.height) if canvas else (_given(request.width, config.width), _given(request.height, config.height))
        video = config.video_shape(width, height, _given(request.frames, config.frames), keyframes=request.keyframe_roles)
        asked = schedule if schedule is not None and not schedule.empty else None
        adapter = lambda field: getattr(asked, field) if asked is not None else None  # noqa: E731
        steps = _agreed(request.steps, asked.points if asked else None, "--steps", asked)
        return cls(
            **video.model_dump(), steps=_given(steps, config.steps),
            video_shift=_given(_agreed(request.video_shift, adapter("video_shift"), "--video-shift", asked), config.video_shift),
            audio_shift=_given(_agreed(request.audio_shift, adapter("audio_shift"), "--audio-shift", asked), config.audio_shift),
            video_sigmas=adapter("video_sigmas"), audio_sigmas=adapter("audio_sigmas"), schedule_source=asked.source if asked else "",
        )

    @property
    def forwards(self) -> int:
        return self.steps - 1


class ResolvedRun(BaseModel):
    """A request resolved against its checkpoint: what the ranks execute."""

    model_config = ConfigDict(frozen=True)
    request: GenerateRequest
    config: ModelConfig
    checkpoint: Path
    synthetic: bool
    shape: RunShape
    plan: ParallelPlan = Field(description="The partition every rank runs: heads, each sequence's tokens, tensor-mode shards, weights per rank.")
    canvas: Canvas | None = Field(None, description="The size generated and why: the flags, the first keyframe's aspect, or the preset.")
    keyframes: KeyframePlan | None = Field(None, description="FL2VA: the keyframes, checked, and the video VAE that encodes them (None: t2va).")
    adapters: list[AdapterRecord] = Field(default_factory=list, description="The request's LoRA adapters, checked, hashed and costed per rank (h3core.lora.plan).")
    fp4_selftest: dict[str, FP4SelfTest] | None = Field(None, description="The launcher's fp4 GEMM self-test per GPU of this machine's ranks (h3core.generate.fp4gate); None where no fp4 GEMM can run.")
    memory_check: MemoryCheck | None = Field(None, description="How the ranks' device memory was checked before they started (the dry run, or the formula and why); None: only the formula in `resolve`.")


def _given(value, default):  # type: ignore[no-untyped-def]
    return default if value is None else value


def _agreed(mine, adapter, flag: str, schedule: AdapterSchedule | None):  # type: ignore[no-untyped-def]
    """The request's value, else the adapters'; both given and different is one line (the adapter was trained for its own)."""
    if mine is not None and adapter is not None and mine != adapter:
        raise AdapterError(f"{flag} {mine} contradicts the schedule {schedule.source if schedule else ''} ships in its metadata "  # type: ignore[union-attr]
                           f"({flag.removeprefix('--')} {adapter}): leave {flag} out to sample as it was trained, or remove that adapter")
    return mine if mine is not None else adapter


def resolve(request: GenerateRequest, video_vae: Path | None = None, *, check_gpus: Callable[[ResolvedRun], ResolvedRun] | None = None) -> ResolvedRun:
    """Pick the config, canvas, sizes, plan and checkpoint; validate everything before spawning (module
    docstring). `video_vae`: the --video-vae flag (it also encodes the keyframes). `check_gpus`: the
    caller's check of the GPUs' memory (`h3 generate`: the dry run of the ranks' code,
    `h3core.generate.dryrun.check_device_memory`), given the run before its weights are checked whole
    or built; None: the formula checks them here, with the host."""
    base = get_preset(request.preset or ("h3" if request.model_path else "tiny"))
    checkpoint = Checkpoint.open(request.model_path, base) if request.model_path is not None else None
    config = checkpoint.config if checkpoint else base
    adapters = open_adapters(request.loras, config)  # checked before anything is planned: a bad adapter is one line
    opened = open_keyframes(request.keyframes) if request.keyframes else []  # type: ignore[arg-type]
    first = (str(request.keyframes[opened[0][0]]), opened[0][1].size) if opened else None  # type: ignore[index]  # the first image given sets the canvas
    canvas = resolve_canvas(config, request.width, request.height, first)
    shape = RunShape.of(config, request, canvas, adapters_schedule(adapters))
    _check_backends(request, config)
    specs = checkpoint.specs() if checkpoint else None
    plan = build_plan(request, config, shape, specs=specs)
    elements = shape.latent_elements
    dtype = compute_dtype(request.device, request.dtype)
    plan = _with_decoded_weights(request, config, plan, specs, elements, shape.steps, dtype)
    plan = with_overlap(plan, request.ulysses_overlap, request.device)
    records = adapter_records(adapters, config, plan, dtype)
    check_limits(config, plan, elements, shape.steps, request.device, dtype, request.attention,
                 adapter_bytes=max(adapter_bytes_per_rank(records, len(plan.ranks)), default=0), device_part=check_gpus is None)
    synthetic = checkpoint is None or checkpoint.weights == SYNTHETIC
    keyframes = _keyframe_plan(request, opened, shape, video_vae, synthetic)
    if keyframes is not None:
        check_encode_memory(keyframes, request, config, plan.layout.world_size)
    run = ResolvedRun(request=request, config=config, checkpoint=_planned_checkpoint(request, checkpoint, base), synthetic=synthetic,
                      shape=shape, plan=plan, canvas=canvas, keyframes=keyframes, adapters=records)
    if check_gpus is not None:
        run = check_gpus(run)  # before the weights: a run that cannot fit builds nothing
    path, synthetic = _weights(request, checkpoint, base)
    return run.model_copy(update={"checkpoint": path, "synthetic": synthetic})


def _keyframe_plan(request: GenerateRequest, opened: list, shape: "RunShape", video_vae: Path | None, synthetic: bool) -> KeyframePlan | None:
    """The request's keyframes, checked, and the video VAE that encodes them (None: t2va)."""
    if not opened:
        return None
    vae, source = keyframe_vae(video_vae, request.model_path, synthetic)
    return KeyframePlan(roles=shape.keyframes, paths=[str(request.keyframes[role]) for role, _ in opened],  # type: ignore[index]
                        sizes=[image.size for _, image in opened], video_vae=vae, video_vae_source=source)


def _planned_checkpoint(request: GenerateRequest, checkpoint: Checkpoint | None, base: ModelConfig) -> Path:
    """The checkpoint the run will load: the file given, else (not built yet) a name for the synthetic
    layout of `base`, which a dry run reads as the synthetic specs."""
    if checkpoint is not None and request.model_path is not None:
        return Path(request.model_path)
    return Path(f"synthetic-{base.name}.safetensors")


def _with_decoded_weights(request: GenerateRequest, config: ModelConfig, plan: ParallelPlan, specs, elements: int, steps: int, dtype) -> ParallelPlan:  # type: ignore[no-untyped-def]
    """The plan with its decoded-weights record for this machine's GPU, or its host memory on the CPU
    (`h3core.parallel.decoded`)."""
    from h3core.model.synthetic import synthetic_specs
    from h3core.runtime.limits import capacity

    capability = gpu_bytes = host_bytes = None
    import torch

    ranks = settings.ranks_on_this_machine(plan.layout.world_size)
    if request.device == "cuda" and torch.cuda.is_available():  # (a run planned for CUDA on a host without one: no GPU to decide for)
        capability = tuple(torch.cuda.get_device_capability(0))
        gpu_bytes = min(capacity("cuda", ranks).gpu_bytes or [0]) or None
    elif request.device == "cpu":
        host_bytes = capacity("cpu", ranks).host_bytes
    prefixes = sorted({s.prefix for s in (specs or synthetic_specs(config)) if s.name.endswith(".weight_scale")})
    return plan_decoded_weights(plan, config, request.decoded_weights, prefixes, capability=capability, gpu_bytes=gpu_bytes,  # type: ignore[arg-type]
                                latent_elements=elements, steps=steps, dtype=dtype, attention=request.attention, host_bytes=host_bytes)


def with_overlap(plan: ParallelPlan, choice: str, device: str) -> ParallelPlan:
    """The plan with its Ulysses overlap record (`h3core.parallel.overlap`); tensor mode has none."""
    from h3core.parallel import overlap

    if plan.mode is not Mode.ULYSSES:
        return plan
    return plan.model_copy(update={"overlap": overlap.choose(choice, backend=overlap.backend_of(device), heads_per_rank=plan.heads)})


def _check_backends(request: GenerateRequest, config: ModelConfig) -> None:
    """The attention backend for this device, head width and dtype; a malformed H3_EMULATE_FP4; with
    --compile, what compiling needs here."""
    from h3core.model import attention
    from h3core.model.compiled import check_compile
    from h3core.runtime import device

    dtype = device.compute_dtype(request.device, request.dtype)
    attention.check_backend(request.attention, request.device, head_dim=config.head_dim, dtype=dtype)
    settings.emulate_fp4()
    if request.compile:
        check_compile(request.device)
        if request.profile:
            raise ConfigError("--profile times the modules of an eager forward and cannot see inside a compiled block: run it without --compile")


def build_plan(request: GenerateRequest, config: ModelConfig, shape: RunShape, specs=None) -> ParallelPlan:  # type: ignore[no-untyped-def]
    """The plan of every sequence the ranks will run, from the prompts' real token counts (with keyframes:
    as the text encoder presents them, each row tagged), for the request's layout of ranks (checked
    first: a count that does not split is one line); `specs`: the checkpoint's tensors (None: the
    synthetic layout) for the bytes each rank holds."""
    from h3core.text import check_text_encoder

    layout = rank_layout(request)
    keyframes = len(shape.keyframes)
    if keyframes:
        tags = [presented_tags(request.text_encoder_path, config.text_dim, p, (shape.width, shape.height), keyframes) for p in request.prompts]
    else:
        tokenizer = check_text_encoder(request.text_encoder_path, hidden_size=config.text_dim)
        tags = [[1] * len(tokenizer.encode(p)) for p in request.prompts]
    sequences = [config.segments(shape.width, shape.height, shape.frames, len(t), keyframes=keyframes, text_tags=t) for t in tags]
    return ParallelPlan.for_layout(config, layout, request.mode, *sequences, specs=specs)


def rank_layout(request: GenerateRequest) -> RankLayout:
    """How the request's ranks form groups (replicas x CFG halves x ranks per sequence); `LayoutError` where they cannot."""
    return RankLayout.of(request.world_size, cfg_parallel=request.cfg_parallel, replicas=request.replicas,
                         guided=request.guidance_scale != 1.0)


def _weights(request: GenerateRequest, checkpoint: Checkpoint | None, base: ModelConfig) -> tuple[Path, bool]:
    """The checkpoint file the ranks load (checked whole), and whether it is synthetic (built last, if needed)."""
    from h3core.model.synthetic import synthetic_checkpoint

    if checkpoint is None:
        return synthetic_checkpoint(base, seed=0)[0], True
    checkpoint.validate()
    checkpoint.file.reader.close()
    return Path(request.model_path), checkpoint.weights == SYNTHETIC  # type: ignore[arg-type]


def check_torchrun_parity(parity: bool) -> None:
    """`--parity` runs a one-rank reference in the launching process: not under torchrun."""
    if parity and settings.under_torchrun():
        raise ConfigError("--parity runs a one-rank reference in the launching process; run it without torchrun, or use `h3 verify parity`")
