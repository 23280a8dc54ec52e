"""The report of one `h3 generate` run (DESIGN.md §6): what every rank sends back, and the run's report built from them."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, computed_field

from h3core import settings
from h3core.decode.report import DecodeReport
from h3core.errors import CheckFailed
from h3core.files.fingerprint import file_identity
from h3core.generate.cache import CacheRecord
from h3core.generate.compile_record import CompileRecord, slowest
from h3core.generate.fp4gate import untested_shapes
from h3core.generate.keyframes import Canvas, KeyframePlan
from h3core.generate.memory import MemoryCheck
from h3core.generate.parity import LatentParity
from h3core.generate.profile import RankProfile, RunProfile
from h3core.generate.request import ResolvedRun, RunShape
from h3core.generate.wall import WallTime
from h3core.lora.plan import AdapterRecord
from h3core.model.checkpoint import SYNTHETIC
from h3core.model.config import ModelConfig
from h3core.nvfp4.selftest import FP4SelfTest
from h3core.model.sequence import KINDS, kind_length
from h3core.parallel.collectives import CommStats
from h3core.parallel.modes import Mode
from h3core.parallel.plan import ParallelPlan
from h3core.parallel.runtime import RankUsage
from h3core.reports.schema import TensorChecksum, Versions, timestamp
from h3core.runtime import device as dev


class StepDone(BaseModel):
    """Progress message rank 0 sends after each denoising step."""

    step: int
    steps: int
    seconds: float


class HeldWeights(BaseModel):
    """Weight memory of one rank, measured: the per-block linears tensor mode shards, and everything else."""

    resident: int = Field(description="Bytes of every parameter and buffer the rank holds.")
    read: int = Field(description="Bytes this rank read from the checkpoint.")
    block_linears_resident: int = Field(description="Held bytes of the blocks' QKV/Out/FC1/FC2 (with their biases).")
    block_linears_read: int = Field(description="Bytes of those linears read from disk.")
    block_linears_full: int = Field(description="Their size in the checkpoint: what one unsharded rank holds.")

    @property
    def block_share(self) -> float:
        """Held fraction of the full block linears (tensor mode at N ranks: about 1/N)."""
        return self.block_linears_resident / self.block_linears_full if self.block_linears_full else 1.0


class RankReport(BaseModel):
    """What one rank ran and measured for one request: produced on the rank (`rank_generate`), sent
    back as it is, and embedded as it is in the run's report (`RunReport.ranks`). The lead of each
    replica also carries the final latents (`latents`, not serialised: they go to latents.safetensors)."""

    model_config = ConfigDict(arbitrary_types_allowed=True)
    rank: int
    timings: dict[str, float] = Field(default_factory=dict, description="Seconds per phase on this rank (text_encode, load, sampling, gather).")
    step_seconds: list[float] = Field(default_factory=list, description="Seconds per denoising step on this rank.")
    peak_memory_text_bytes: int = Field(0, description="Peak device memory while the text encoder ran (rank 0).")
    peak_memory_sampling_bytes: int = Field(0, description="Peak device memory of the denoising loop (CPU: the process's peak RSS).")
    memory_before_sampling_bytes: int = Field(0, description="The same measure when the loop's window opened (weights, latents, and on the CPU the process itself): the peak less this is what sampling added.")
    weights: HeldWeights | None = None
    comm: CommStats = Field(default_factory=CommStats)
    nvfp4_paths: dict[str, int] = Field(default_factory=dict, description="NVFP4 matmul path -> GEMM calls this rank ran in the denoising loop.")
    attention_kernels: dict[str, int] = Field(default_factory=dict, description="Attention kernel -> calls this rank ran in the denoising loop.")
    fp4_gemm_shapes: list[list[int]] = Field(default_factory=list, description="Every distinct fp4 GEMM [M, N, K] this rank ran (padded), to compare with the fp4 self-test's.")
    used: RankUsage | None = Field(None, description="The heads, rows of each sequence and tensor-mode shards this rank ran with (the run's `partition` planned them).")
    cpu_allocator: str = Field("n/a", description="CPU runs: this rank's allocator policy (h3core.runtime.cpu_memory).")
    profile: RankProfile | None = Field(None, description="With --profile: where each step's time went on this rank.")
    text_encoder: dict | None = Field(None, description="Rank 0: what the text encoder loaded and read.")
    adapter_bytes: int = Field(0, description="Bytes of the LoRA branches this rank held for the request (h3core.lora), beside `weights`.")
    cache: CacheRecord | None = Field(None, description="With --cache: the steps whose blocks 1.. each sequence skipped, and why (h3core.model.step_cache).")
    compile: CompileRecord | None = Field(None, description="With --compile: the seconds each step spent compiling the blocks, and the step times without them (h3core.model.compiled).")
    _video: torch.Tensor | None = PrivateAttr(default=None)  # [24, T, H/16, W/16] float32, a replica's lead
    _audio: torch.Tensor | None = PrivateAttr(default=None)  # [2, 32, T_a] float32
    _condition: torch.Tensor | None = PrivateAttr(default=None)  # [24, n_keyframes, H/16, W/16] float32: the keyframes' normalized latents

    @computed_field  # type: ignore[prop-decorator]
    @property
    def sampling_seconds(self) -> float:
        return self.timings.get("sampling", 0.0)

    @property
    def video(self) -> torch.Tensor | None:
        return self._video

    @property
    def audio(self) -> torch.Tensor | None:
        return self._audio

    @property
    def condition_video(self) -> torch.Tensor | None:
        return self._condition

    @property
    def latents(self) -> dict[str, torch.Tensor | None]:
        """What latents.safetensors holds: `video`, `audio` and, with keyframes, `condition_video`."""
        out = {"video": self._video, "audio": self._audio}
        if self._condition is not None:
            out["condition_video"] = self._condition
        return out

    def carry(self, video: torch.Tensor | None, audio: torch.Tensor | None, condition: torch.Tensor | None = None) -> None:
        """Attach the final latents (the lead of a replica), and the keyframes' condition latents it denoised with."""
        self._video, self._audio, self._condition = video, audio, condition


class Schedules(BaseModel):
    """The two sigma schedules a run sampled with (`h3core.model.sampler`): the model is fed 1 - sigma."""

    points: int = Field(description="Sigma points of each schedule, terminal 0 included (points - 1 forwards).")
    video_shift: float
    audio_shift: float
    video_sigmas: list[float]
    audio_sigmas: list[float]
    source: str = Field("", description="'' (the request and the preset), or the adapter(s) whose metadata set the schedule (h3core.lora.schedule).")

    @classmethod
    def of(cls, shape: RunShape) -> "Schedules":
        from h3core.model.sampler import FlowMatchH3

        video, audio = FlowMatchH3(shape.video_shift), FlowMatchH3(shape.audio_shift)
        video.set_timesteps(shape.steps, shape.video_sigmas)
        audio.set_timesteps(shape.steps, shape.audio_sigmas)
        return cls(points=shape.steps, video_shift=shape.video_shift, audio_shift=shape.audio_shift,
                   video_sigmas=video.sigmas.tolist(), audio_sigmas=audio.sigmas.tolist(), source=shape.schedule_source)


class RunFiles(BaseModel):
    directory: str
    report: str
    latents: str | None
    preview: str | None
    video: str | None = Field(None, description="video.mp4 (None with --no-decode).")
    benchmark: str | None = None


SCHEMA = 2
"""The shape of `RunReport`: 2 (MiniMax-H3's shapes and schedules; `ranks[]` is each rank's own
`RankReport`); 1 (unversioned) before."""


class RunReport(BaseModel):
    """Everything about one `h3 generate` run (DESIGN.md §6)."""

    schema_version: int = Field(SCHEMA, description="The shape of this report (h3core.generate.report.SCHEMA).")
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
    weights: str  # "synthetic", or the checkpoint path and the bytes of its weights (`weights_label`)
    checkpoint: str
    config: ModelConfig
    text_encoder: dict
    prompt: str
    negative_prompt: str
    guidance_scale: float
    seed: int
    noise_recipe: str = Field("official", description="Whose noise the seed means: official (the official server's) or diffusers (h3core.model.sampler).")
    canvas: Canvas | None = Field(None, description="The size generated and why: --width/--height, the first keyframe's aspect, or the preset's.")
    keyframes: KeyframePlan | None = Field(None, description="FL2VA: the keyframes (role, file, size) and the video VAE that encoded them; their latents are latents.safetensors' condition_video.")
    shape: RunShape
    schedules: Schedules
    num_tokens: int
    rows: dict[str, int] = Field(description="Rows of the prompt's packed sequence per kind: text (vision blocks included), condition (keyframes), audio, video.")
    partition: ParallelPlan
    timings: dict[str, float]  # per phase, the slowest rank
    step_seconds: list[float]  # per step, the slowest rank
    cache: CacheRecord | None = Field(None, description="With --cache: the forwards computed and skipped per sequence (every rank of a sequence decides alike).")
    compile: CompileRecord | None = Field(None, description="With --compile: the rank that spent the longest compiling, step by step (step_seconds stay wall times, compile included).")
    wall: WallTime | None = Field(None, description="Where the wall time went, stage by stage, from the process's start to the report (h3 generate with one prompt; h3core.generate.wall).")
    ranks: list[RankReport] = Field(description="Every rank's own report, as the rank made it.")
    comm_total: CommStats
    video: TensorChecksum | None
    audio: TensorChecksum | None
    parity: LatentParity | None = None  # with --parity: vs the single-rank run (at 1 rank: vs the other mode)
    cpu_allocator: str = "n/a"  # CPU runs: the ranks' allocator policy (h3core.runtime.cpu_memory)
    profile: RunProfile | None = None  # with --profile: per rank and step, where the time went
    fp4_selftest: dict[str, FP4SelfTest] | None = Field(None, description="The fp4 GEMM self-test of each GPU, run before the ranks started (h3core.generate.fp4gate); None where no fp4 GEMM could run.")
    fp4_untested_shapes: list[list[int]] = Field(default_factory=list, description="fp4 GEMM [M, N, K] a rank ran that the self-test did not check (empty: it covered every call).")
    memory_check: MemoryCheck | None = Field(None, description="How the ranks' device memory was checked before they started: the dry run, or the formula and why (a dry run that failed says so here).")
    adapters: list[AdapterRecord] = Field(default_factory=list, description="The LoRA adapters applied: name, sha256, format, scale, layers, bytes per rank (h3core.lora).")
    adapters_applied: str = Field("", description="How the adapters were applied (a low-rank branch beside each linear; never merged into a weight).")
    decode: DecodeReport | None = Field(None, description="The latents decoded into video.mp4 in this process once the ranks were done (None with --no-decode).")
    files: RunFiles | None = None
    request_fingerprint: str | None = Field(None, description="sha256 of the resolved request (`request_fingerprint`): equal for two runs of the same request; how `h3 generate --prompts` knows a result is complete.")
    versions: Versions

    def failure(self) -> CheckFailed | None:
        """The error to exit with: parity measured and not within its bound, or a video.mp4 that
        breaks the mp4 contract (None otherwise)."""
        p = self.parity
        if p is None or p.passed:
            return self.decode.failure() if self.decode is not None else None
        where = f" (report: {self.files.report})" if self.files else ""
        return CheckFailed(f"latent parity failed: relative error {p.relative:.3g} > tolerance {p.tolerance:g} vs {p.reference}{where}")


def request_fingerprint(run: ResolvedRun, portable: bool = False) -> str:
    """sha256 of everything that decides the run's result: the resolved request (prompt, sizes, seed,
    guidance, mode, ranks, dtype, attention, config, plan) with the weights named by what they
    hold, not where (`file_identity` of the checkpoint and the text encoder: their content, and
    their modification time unless `portable`), and every setting that changes numbers
    (`settings.result_settings`). A changed prompt, seed, size, weight file or H3_EMULATE_FP4
    changes it, and so do another keyframe image or the video VAE that encodes it; `portable` is the
    same on machines holding their own copies (torchrun's ranks)."""
    request = run.request
    # (the fp4 self-test and the memory check are this machine's verdicts on its GPUs, each torchrun process its own: not the
    # request; nor is holding NVFP4 weights decoded, a choice by the host's free memory with the same bits either way)
    fields = run.model_dump(mode="json", exclude={"checkpoint": True, "fp4_selftest": True, "memory_check": True, "plan": {"decoded"},
                                                  "request": {"model_path", "text_encoder_path", "profile", "keyframes", "loras"},
                                                  "keyframes": {"paths", "video_vae"}, "adapters": {"__all__": {"path"}}})
    fields["weights"] = {
        "checkpoint": file_identity(run.checkpoint, portable),
        "text_encoder": file_identity(request.text_encoder_path, portable) if request.text_encoder_path else "synthetic",
    }
    if run.keyframes is not None:  # the images and the VAE that encodes them, by content
        fields["keyframes"] = {role: file_identity(Path(path), portable) for role, path in zip(run.keyframes.roles, run.keyframes.paths)}
        fields["weights"]["keyframe_vae"] = file_identity(run.keyframes.video_vae, portable) if run.keyframes.video_vae else "synthetic"
    fields["settings"] = settings.result_settings()
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


def ranks_on(world_size: int, device: str) -> str:
    """'8 GPUs (NCCL)', '6 CPU ranks (Gloo)' or '1 CPU process'."""
    if device == "cuda":
        return f"{world_size} GPU{'s' if world_size > 1 else ''} (NCCL)"
    return f"{world_size} CPU ranks (Gloo)" if world_size > 1 else "1 CPU process"


def per_rank_summary(records: list[dict[str, int]]) -> str:
    """What ranks ran: 'a + b' when every rank ran the same set, else one 'rank r: ...' entry per rank."""
    names = [" + ".join(sorted(record)) or "none" for record in records]
    if len(set(names)) == 1:
        return names[0]
    return "; ".join(f"rank {rank}: {name}" for rank, name in enumerate(names))


def weights_label(run: ResolvedRun) -> str:
    """`synthetic`, or the checkpoint and the bytes of its weights: its tensors as stored, what the plan
    counted (never the size of a path's own entry: a folder's is some 4,096 bytes, a file's adds its header)."""
    if run.synthetic:
        return SYNTHETIC
    weights = run.plan.weights
    return f"{run.checkpoint} ({weights.checkpoint_bytes:,} bytes of weights)" if weights is not None else str(run.checkpoint)


def build_report(run: ResolvedRun, outcomes: list[RankReport]) -> RunReport:
    """The run's report from every rank's outcome (rank 0's first: it carries the latents)."""
    req, first = run.request, outcomes[0]
    return RunReport(
        created=timestamp(), mode=req.mode, world_size=req.world_size, device=req.device,
        device_name=dev.device_name(req.device), ranks_on=ranks_on(req.world_size, req.device),
        dist_backend="none" if req.world_size == 1 else ("nccl" if req.device == "cuda" else "gloo"),
        dtype=dev.dtype_name(dev.compute_dtype(req.device, req.dtype)), attention=req.attention,
        attention_kernel=per_rank_summary([o.attention_kernels for o in outcomes]),
        nvfp4_path=per_rank_summary([o.nvfp4_paths for o in outcomes]),
        weights=weights_label(run),
        checkpoint=str(run.checkpoint), config=run.config, text_encoder=first.text_encoder or {},
        prompt=req.prompt, negative_prompt=req.negative_prompt, guidance_scale=req.guidance_scale, seed=req.seed,
        noise_recipe=req.noise_recipe.value, canvas=run.canvas, keyframes=run.keyframes, shape=run.shape, schedules=Schedules.of(run.shape), num_tokens=run.plan.num_tokens,
        rows={kind.value: kind_length(run.plan.segments, kind) for kind in KINDS}, partition=run.plan,
        timings=_slowest_phases(outcomes), step_seconds=_slowest_steps(outcomes),
        ranks=outcomes, comm_total=CommStats.total(o.comm for o in outcomes),
        video=TensorChecksum.of(first.video) if first.video is not None else None,
        audio=TensorChecksum.of(first.audio) if first.audio is not None else None,
        cpu_allocator=first.cpu_allocator,
        profile=RunProfile.of([o.profile for o in outcomes]) if all(o.profile for o in outcomes) else None,
        request_fingerprint=request_fingerprint(run), versions=Versions.collect(),
        fp4_selftest=run.fp4_selftest, memory_check=run.memory_check,
        fp4_untested_shapes=untested_shapes(run, sorted({tuple(s) for o in outcomes for s in o.fp4_gemm_shapes})) if run.fp4_selftest else [],
        adapters=run.adapters, adapters_applied=ADAPTERS_APPLIED if run.adapters else "",
        cache=_cache_of(outcomes), compile=slowest([o.compile for o in outcomes]),
    )


def _cache_of(outcomes: list[RankReport]) -> CacheRecord | None:
    """The step cache's record of every sequence (with CFG parallel each half's ranks ran one)."""
    records = [o.cache for o in outcomes if o.cache is not None]
    if not records:
        return None
    sequences = {}
    for record in records:
        for name, sequence in record.sequences.items():
            sequences.setdefault(name, sequence)
    return records[0].model_copy(update={"sequences": sequences})


ADAPTERS_APPLIED = ("a low-rank branch y += s * B(A x) beside each adapted linear, in the linear's compute dtype; the linear's (NVFP4) "
                    "weight untouched and never merged, also where it is held decoded (--decoded-weights): the same branch on every path")


def _slowest_phases(outcomes: list[RankReport]) -> dict[str, float]:
    """Per phase, the slowest rank's seconds."""
    phases = sorted({k for o in outcomes for k in o.timings})
    return {p: max(o.timings.get(p, 0.0) for o in outcomes) for p in phases}


def _slowest_steps(outcomes: list[RankReport]) -> list[float]:
    """Per denoising step, the slowest rank's seconds."""
    return [max(o.step_seconds[i] for o in outcomes) for i in range(len(outcomes[0].step_seconds))]
