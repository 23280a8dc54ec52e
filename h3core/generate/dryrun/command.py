"""The dry run's command glue: the device-memory check before a CUDA run (`check_device_memory`),
`h3 plan --memory` (`plan_memory`), and a prediction next to a run's measured peaks
(`compare_with_report`, `python -m h3core.generate.dryrun REPORT`).

One memory model: on a CUDA run the dry run of the ranks' own code (`predict.dry_run`) decides
whether each rank's device peak fits its GPU. The formula (`h3core.generate.memory.generate_need`,
a lower bound) is its documented fallback, used where no dry run can run here (no CUDA device, a
CPU-only torch without a compiler for the fake device's guard, a torchrun rank) or where one did
not finish: then the run's `MemoryCheck` says so, in one line and in the report. CPU ranks share
the host's memory with their processes, which fake tensors do not see: the formula checks them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Sequence

import torch
from pydantic import BaseModel, Field

from h3core import settings
from h3core.decode.memory import DecodeMemory
from h3core.errors import ConfigError, DryRunFailed, ResourceLimit
from h3core.generate.dryrun.predict import ARCHS, DryRun, arch_of, dry_run, dry_run_problem
from h3core.generate.memory import MemoryCheck, check_limits
from h3core.generate.request import ResolvedRun
from h3core.parallel.modes import Mode
from h3core.parallel.plan import ParallelPlan
from h3core.reports.units import format_bytes


def check_device_memory(run: ResolvedRun, *, arch: str | None = None, usable_bytes: int | None = None,
                        dry: Callable[[ResolvedRun, str], DryRun] = dry_run) -> tuple[MemoryCheck, DryRun | None]:
    """Refuse (one line, `ResourceLimit`) a run whose ranks' device peak does not fit a GPU here, by
    the dry run where one can run, else by the formula; returns how it was checked and the dry run
    (its fp4 GEMM shapes are what the self-test then checks). `arch`, `usable_bytes`: this
    machine's GPU (default: cuda:0's and its usable memory); `dry`: the dry run to take (a test
    passes one whose seam it broke)."""
    from h3core.runtime.device import compute_dtype
    from h3core.runtime.limits import capacity

    req, shape = run.request, run.shape
    if not settings.memory_check():
        return MemoryCheck(model="off", line=f"{settings.MEMORY_CHECK}=0: no memory check"), None
    if req.device != "cuda":
        return MemoryCheck(model="formula", line="CPU ranks: the formula checked the host's memory (h3core.generate.memory)"), None
    if arch is None and torch.cuda.is_available():
        arch = arch_of(torch.cuda.get_device_capability(0))
    usable = usable_bytes if usable_bytes is not None else min(capacity("cuda", settings.ranks_on_this_machine(run.plan.layout.world_size)).gpu_bytes or [0])
    problem, failed = ("no CUDA device here to predict for" if arch is None else dry_run_problem(arch)), False
    if problem is None and arch is not None:
        try:
            predicted = dry(run, arch)
        except DryRunFailed as err:
            if settings.debug():
                raise
            problem, failed = str(err), True
        else:
            return _check_peaks(predicted, usable), predicted
    dtype = compute_dtype(req.device, req.dtype)
    need = check_limits(run.config, run.plan, shape.latent_elements, shape.steps, req.device, dtype, req.attention, host_part=False, gpu_bytes=usable or None)
    peak = sum(need.on_device.values())
    line = f"{problem}; the memory formula (a lower bound) checked instead: at least {format_bytes(peak)} per GPU"
    return MemoryCheck(model="formula", line=line, failed=failed, peak_bytes=peak), None


def _check_peaks(predicted: DryRun, usable: int) -> MemoryCheck:
    peaks = predicted.peaks()
    worst = max(range(len(peaks)), key=peaks.__getitem__)
    if usable and peaks[worst] > usable:
        raise ResourceLimit(
            f"the dry run of this run's own code predicts a peak of {format_bytes(peaks[worst])} of GPU memory on rank {worst}, but a GPU "
            f"here has {format_bytes(usable)} usable; use tensor mode, more GPUs or a smaller --width/--height/--frames "
            f"(h3 plan --memory shows each rank's peak); {settings.MEMORY_CHECK}=0 skips this check"
        )
    line = f"dry run ({predicted.arch}, {predicted.seconds:.1f}s): largest rank's peak {format_bytes(peaks[worst])} (rank {worst})" + (f" of {format_bytes(usable)} usable" if usable else "")
    return MemoryCheck(model="dry run", line=line, peak_bytes=peaks[worst])


# --- h3 plan --memory ------------------------------------------------------------------------------------


class PlanMemory(BaseModel):
    """`h3 plan --memory`: the plan (with the decoded-weights choice of the first architecture) and, per
    architecture, the dry run of every rank."""

    plan: ParallelPlan
    dry_runs: list[DryRun]
    skipped: str | None = Field(None, description="Why no dry run ran here (then `dry_runs` is empty).")
    adapters: list = Field(default_factory=list, description="The LoRA adapters counted (`AdapterRecord`: bytes per rank on the plan).")
    keyframe_encode: dict[str, dict[str, int]] = Field(default_factory=dict, description="With keyframes: rank 0's device bytes before the denoiser loads, per phase (the video VAE's encoder, the vision tower), a lower bound by formula (h3core.generate.keyframes).")
    decode: DecodeMemory | None = Field(None, description="The decode after denoising, shared out over the run's ranks: each rank's peak (`h3core.decode.memory`; the real VAEs for `h3` presets, else the synthetic ones).")


def plan_memory(preset_name: str, count: int | None, mode: Mode, *, archs: Sequence[str] = tuple(ARCHS), width: int | None = None,
                height: int | None = None, frames: int | None = None, text_tokens: int | None = None, cfg_parallel: bool = False,
                replicas: int = 1, decoded_weights: str = "auto", keyframes: tuple[str, ...] = (),
                loras: Sequence = ()) -> PlanMemory:
    """The dry run of preset `preset_name`'s synthetic layout (the seed's file, tensor for tensor, for `h3`)
    at `count` ranks for each of `archs`, without building any checkpoint (with `keyframes`: their
    condition rows and the prompt's vision blocks in the sequence). An unknown architecture is
    a ConfigError before anything is computed; one that cannot dry-run here is `skipped`."""
    unknown = [a for a in archs if a != "cpu" and a not in ARCHS]
    if unknown:
        raise ConfigError(f"--arch {unknown[0]}: unknown architecture; choose one of: {', '.join(ARCHS)}, cpu")
    plan = planned_preset(preset_name, count, mode, width=width, height=height, frames=frames, text_tokens=text_tokens,
                          cfg_parallel=cfg_parallel, replicas=replicas, keyframes=keyframes)
    problems = [p for p in (dry_run_problem(a) for a in archs) if p]
    runs, first, adapters = [], None, []
    for arch in archs if not problems else ():
        run = preset_run(plan, preset_name, arch, width=width, height=height, frames=frames, decoded_weights=decoded_weights, keyframes=keyframes,
                         loras=loras)
        first, adapters = first or run.plan, adapters or run.adapters
        runs.append(dry_run(run, arch))
    if problems and loras:
        adapters = preset_run(plan, preset_name, "cpu", width=width, height=height, frames=frames, loras=loras).adapters
    from h3core.generate.keyframes import keyframe_encode_estimate

    encode = keyframe_encode_estimate(preset_name) if keyframes else {}
    return PlanMemory(plan=first or plan, dry_runs=runs, skipped=problems[0] if problems else None, keyframe_encode=encode,
                      adapters=adapters, decode=plan_decode_memory(preset_name, plan, "cpu" if list(archs) == ["cpu"] else "cuda", width, height, frames))


def plan_decode_memory(preset_name: str, plan: ParallelPlan, device: str, width: int | None, height: int | None, frames: int | None) -> DecodeMemory:
    """The decode of `plan`'s clip over all its ranks on `device`: the real VAEs' widths for an `h3`
    preset (the checkpoint's), the synthetic VAEs' for the others (what they decode with)."""
    from h3core.decode.memory import REAL_AUDIO, REAL_VIDEO, AudioDecoderSize, VideoDecoderSize, estimate_decode_memory
    from h3core.decode.synthetic import SYNTHETIC_AUDIO_CONFIG, SYNTHETIC_VIDEO_CONFIG
    from h3core.model.config import preset

    config = preset(preset_name)
    size = settings.SizeFlags(width=width, height=height, frames=frames).or_defaults(config.width, config.height, config.frames)
    real = preset_name.startswith("h3")
    video = REAL_VIDEO if real else VideoDecoderSize.of(SYNTHETIC_VIDEO_CONFIG)
    audio = REAL_AUDIO if real else AudioDecoderSize.of(SYNTHETIC_AUDIO_CONFIG)
    return estimate_decode_memory(*size, video=video, audio=audio, ranks=plan.layout.world_size, device=device)


def planned_preset(preset_name: str, count: int | None, mode: Mode, *, width: int | None = None, height: int | None = None,
                   frames: int | None = None, text_tokens: int | None = None, cfg_parallel: bool = False, replicas: int = 1,
                   keyframes: tuple[str, ...] = ()) -> ParallelPlan:
    """`h3 plan`'s plan of a preset; with `keyframes` (anchors) the prompt of `text_tokens` tokens presented
    after them at the canvas (--width/--height, else the preset's: no image to follow) and their condition rows."""
    from h3core.generate.keyframes import planned_text_tags
    from h3core.model.config import preset

    tags = None
    if keyframes:
        config = preset(preset_name)
        canvas = (width or config.width, height or config.height)
        tags = planned_text_tags(config.text_tokens if text_tokens is None else text_tokens, keyframes, canvas)
    return ParallelPlan.for_preset(preset_name, count, mode, width=width, height=height, frames=frames, text_tokens=text_tokens,
                                   cfg_parallel=cfg_parallel, replicas=replicas, keyframes=len(keyframes), text_tags=tags)


def preset_run(plan: ParallelPlan, preset_name: str, arch: str, *, width: int | None = None, height: int | None = None,
               frames: int | None = None, decoded_weights: str = "auto", steps: int | None = None, keyframes: tuple[str, ...] = (), loras: Sequence = ()) -> ResolvedRun:
    """A resolved run of a preset's synthetic checkpoint for `plan` on a GPU of `arch` (its example's memory),
    with the decoded-weights choice made for that GPU and the LoRA adapters `loras` (`LoraSpec`s,
    checked and costed on the plan); the checkpoint is not built (the dry run needs its specs only)."""
    from h3core.generate.memory import plan_decoded_weights
    from h3core.generate.request import GenerateRequest, RunShape
    from h3core.lora.plan import adapter_records, open_adapters
    from h3core.model.config import preset
    from h3core.model.synthetic import synthetic_specs
    from h3core.runtime.limits import CUDA_CONTEXT_BYTES, host_available

    config = preset(preset_name)
    on_gpu = arch != "cpu"
    request = GenerateRequest(preset=preset_name, mode=plan.mode, world_size=plan.layout.world_size, replicas=plan.layout.replicas,
                              cfg_parallel=plan.layout.cfg_parallel, guidance_scale=2.0 if plan.layout.guided else 1.0,
                              width=width, height=height, frames=frames, steps=steps, device="cuda" if on_gpu else "cpu", decoded_weights=decoded_weights)  # type: ignore[arg-type]
    shape = RunShape.of(config, request).model_copy(update={"keyframes": tuple(keyframes)})
    dtype = torch.bfloat16 if on_gpu else torch.float32
    prefixes = sorted({s.prefix for s in synthetic_specs(config) if s.name.endswith(".weight_scale")})
    spec = ARCHS.get(arch)
    elements = shape.latent_elements
    decided = plan_decoded_weights(plan, config, decoded_weights, prefixes, capability=spec.capability if spec else None,
                                   gpu_bytes=spec.total_memory - CUDA_CONTEXT_BYTES if spec else None,
                                   latent_elements=elements, steps=shape.steps, dtype=dtype, attention="sdpa",
                                   host_bytes=None if on_gpu else host_available()[0])
    adapters = adapter_records(open_adapters(loras, config), config, decided, dtype)
    return ResolvedRun(request=request, config=config, checkpoint=Path(f"synthetic-{preset_name}.safetensors"), synthetic=True, shape=shape, plan=decided,
                       adapters=adapters)


# --- python -m h3core.generate.dryrun: a prediction against a run's report (scripts/gpu_check.sh) -----------


def compare_with_report(report_path: Path, arch: str | None = None) -> dict:
    """The dry run of the run an `h3 generate --json` report describes (its preset's synthetic layout,
    mode, count and size) next to the peaks its ranks measured (`peak_memory_sampling_bytes`)."""
    from h3core.files.text import read_json

    report = read_json(report_path, "the report", 64 << 20, "give the report of an h3 generate --json run", want=dict)
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
