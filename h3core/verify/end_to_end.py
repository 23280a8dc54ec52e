"""End-to-end checks through the real pipeline (`h3core.generate.pipeline.rank_generate`):

- `parity`: final latents of both modes at every count vs the single-rank run with the same seed
  and prompt, plus the identity row: tensor mode at one rank must equal Ulysses at one rank bit
  for bit (both are the identity path); then the same for an FL2VA request (`... fl2va` rows: a
  first and a last keyframe, two seeded images written for the check, their condition rows and
  vision blocks in the packed sequence). Tolerances: `h3core.generate.parity.run_tolerance(mode, dtype, paths)`.
- `backends`: each other attention backend (`math`, `sage2`, `flash`) vs `sdpa`, on the same q|k|v
  and on the end-to-end latents of one rank. A backend that is not installed or cannot run on
  this device is skipped with the reason `check_backend` gives.

The single-rank runs (the reference, the other mode, each backend) run on separate ranks of the
World at the same time, each as a world of one, and are shared by both checks. The latents come
back to this process and are compared here with `h3core.generate.parity.latent_parity`.
"""

from __future__ import annotations

import math
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from h3core.errors import BackendUnavailable
from h3core.generate.parity import latent_parity, run_tolerance
from h3core.generate.pipeline import rank_generate
from h3core.generate.request import GenerateRequest, ResolvedRun, resolve
from h3core.model.attention import BACKENDS, attend, check_backend
from h3core.parallel.modes import Mode
from h3core.runtime.context import RankContext
from h3core.runtime.device import Stopwatch
from h3core.verify.compare import measure, seeded, spec_dtype
from h3core.verify.rows import CheckRow, Measure, row_of, skipped, verdict_of
from h3core.verify.session import Check, Session
from h3core.verify.spec import VerifySpec

FL2VA = " fl2va"
"""The suffix of the parity rows of the keyframe (first + last) request."""
PARITY_VARIANTS = tuple(mode.value for mode in Mode) + tuple(mode.value + FL2VA for mode in Mode)
IDENTITY_VARIANT = "tensor = ulysses"
REFERENCE = (Mode.ULYSSES, "sdpa")
"""The single-rank run every latent is compared with (Ulysses at one rank is the identity path)."""

_BACKEND_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 1e-2}
_QUANTIZED_BACKEND_TOLERANCE = {torch.float32: 5e-2, torch.bfloat16: 5e-2, torch.float16: 5e-2}


def backend_tolerance(backend: str, dtype: torch.dtype) -> float:
    """Largest relative error vs sdpa that passes. SageAttention quantizes q and k to int8 (and
    p, v to fp8 on recent GPUs), so it gets a wider bound than the exact-arithmetic backends."""
    table = _QUANTIZED_BACKEND_TOLERANCE if backend == "sage2" else _BACKEND_TOLERANCE
    return table[dtype]


# --- rank side -------------------------------------------------------------------------------------


@dataclass
class LatentRun:
    """Final latents of one run (rank 0's), its wall time, or the error a backend raised."""

    latents: dict[str, torch.Tensor | None]
    seconds: float
    error: str = ""
    nvfp4_paths: dict[str, int] | None = None  # what rank 0's linears ran (the fp4 paths get their own bound)


def generate_on_first_ranks(ctx: RankContext, count: int, run: ResolvedRun) -> LatentRun | None:
    """World task: the whole pipeline on ranks `0..count-1`; rank 0 returns the latents."""
    sub = ctx.first_ranks(count)
    if sub is None:
        return None
    result = _generate(sub, run, catch=False)
    return result if sub.rank == 0 else None


def generate_as_one_rank(ctx: RankContext, run: ResolvedRun, catch: bool) -> LatentRun:
    """Job for `Session.side_by_side`: the pipeline at world size 1. `catch`: report a raised error in the
    result instead of failing the World (for optional backends that may not run these shapes)."""
    return _generate(ctx, run, catch)


def _generate(ctx: RankContext, run: ResolvedRun, catch: bool) -> LatentRun:
    with Stopwatch(ctx.device) as watch:
        try:
            outcome = rank_generate(ctx, run)
        except Exception as err:  # noqa: BLE001 - only with catch, for a backend under test
            if not catch:
                raise
            return LatentRun({}, 0.0, f"{type(err).__name__}: {err}")
    return LatentRun({"video": outcome.video, "audio": outcome.audio}, watch.seconds, nvfp4_paths=outcome.nvfp4_paths)


def measure_backend_attention(ctx: RankContext, spec: VerifySpec, backend: str) -> Measure:
    """Job for `Session.side_by_side`: `attend` with `backend` vs `sdpa` on the same seeded q, k, v."""
    cfg, dtype = spec.config, spec_dtype(spec)
    variant, tol = f"{backend} attention", backend_tolerance(backend, dtype)
    shape = (spec.num_tokens, cfg.num_heads, cfg.head_dim)
    with Stopwatch(ctx.device) as watch, torch.inference_mode():
        q, k, v = (seeded(shape, spec.seed + i, dtype, ctx.device) for i in (1, 2, 3))  # [S, H, Dh] each
        reference = attend(q, k, v, "sdpa")
        try:
            out = attend(q, k, v, backend)
        except Exception as err:  # noqa: BLE001 - an installed backend that cannot run these shapes
            return Measure(variant=variant, max_abs=math.nan, scale=0.0, tolerance=tol, mismatches=[f"{backend} raised {type(err).__name__}: {err}"])
        result = measure(variant, out, reference, tol)
    return result.model_copy(update={"seconds": watch.seconds})


# --- this process -------------------------------------------------------------------------------------


def resolved_run(spec: VerifySpec, mode: Mode, count: int, attention: str, keyframes: dict[str, Path] | None = None) -> ResolvedRun:
    """The `h3 generate` run of the spec (synthetic weights, the verify prompt) for a mode, count and backend
    (with `keyframes`: the FL2VA request, the canvas following the first)."""
    request = GenerateRequest(
        prompt=spec.prompt, preset=spec.config.name, steps=spec.steps, seed=spec.seed, mode=mode,
        world_size=count, device=spec.device, dtype=spec.dtype, attention=attention, keyframes=keyframes or {},
    )
    return resolve(request)


def verify_keyframes(folder: Path, seed: int) -> dict[str, Path]:
    """A first (4:3) and a last (1:1) keyframe of seeded noise over a gradient, written as PNGs in `folder`."""
    import numpy as np
    from PIL import Image

    generator = np.random.default_rng(seed)
    paths = {}
    for role, (width, height) in (("first", (320, 240)), ("last", (256, 256))):
        ramp = np.linspace(0, 255, width, dtype=np.float64)[None, :, None]
        pixels = np.clip(ramp + generator.normal(0, 40, (height, width, 3)), 0, 255).astype(np.uint8)
        paths[role] = folder / f"{role}.png"
        Image.fromarray(pixels, "RGB").save(paths[role])
    return paths


def single_rank_runs(session: Session, keys: list[tuple[Mode, str]], keyframes: dict[str, Path] | None = None) -> dict[tuple[Mode, str], LatentRun]:
    """One-rank runs by (mode, backend) (of the FL2VA request with `keyframes`), computed once per session, the missing ones side by side."""
    task = "fl2va" if keyframes else "t2va"
    missing = [key for key in dict.fromkeys(keys) if ("latents", task, key) not in session.cache]
    if missing:
        session.on_event(f"single-rank {task} runs: " + ", ".join(f"{mode.value}/{backend}" for mode, backend in missing))
        jobs = [(generate_as_one_rank, (resolved_run(session.spec, mode, 1, backend, keyframes), backend != "sdpa")) for mode, backend in missing]
        for key, result in zip(missing, session.side_by_side(jobs)):
            session.cache[("latents", task, key)] = result
    return {key: session.cache[("latents", task, key)] for key in keys}


def latent_row(session: Session, check: str, variant: str, count: int, run: LatentRun, reference: LatentRun, tol: float) -> CheckRow:
    """A row from latents vs the reference's (max over video and audio of the relative error)."""
    base = dict(check=check, mode=variant, count=count, backend=session.backend_at(count), dtype=session.dtype, tolerance=tol, seconds=run.seconds)
    if run.error:
        return CheckRow(**base, verdict="fail", reason=run.error, max_abs=math.nan, relative=math.nan)
    parity = latent_parity(run.latents, reference.latents, tol, "1 rank")
    verdict, reason = verdict_of(parity.max_abs, parity.relative, tol)
    return CheckRow(**base, max_abs=parity.max_abs, relative=parity.relative, verdict=verdict, reason=reason)


def run_parity(session: Session, check: Check) -> list[CheckRow]:
    rows = _parity_rows(session, check, None)
    with tempfile.TemporaryDirectory(prefix="h3-verify-keyframes-") as folder:
        rows += _parity_rows(session, check, verify_keyframes(Path(folder), session.spec.seed))
    return rows


def _parity_rows(session: Session, check: Check, keyframes: dict[str, Path] | None) -> list[CheckRow]:
    """The identity row and both modes at every count, of the t2va request (or with `keyframes`, the FL2VA one)."""
    suffix = FL2VA if keyframes else ""
    runs = single_rank_runs(session, [REFERENCE, (Mode.TENSOR, "sdpa")], keyframes)
    reference = runs[REFERENCE]
    rows = [latent_row(session, check.name, IDENTITY_VARIANT + suffix, 1, runs[(Mode.TENSOR, "sdpa")], reference, 0.0)]
    for count in session.counts:
        if count == 1:
            continue  # the identity row is the one-rank comparison
        if count in session.unusable:
            rows.extend(session.skip_rows(check.name, [v for v in check.variants if v.endswith(FL2VA) == bool(keyframes)], count))
            continue
        for mode in Mode:
            session.on_event(f"parity {mode.value}{suffix} at {count} ranks")
            run = resolved_run(session.spec, mode, count, "sdpa", keyframes)
            started = time.perf_counter()
            result = session.world.run(generate_on_first_ranks, count, run)[0]
            result.seconds = time.perf_counter() - started
            tol = run_tolerance(mode, spec_dtype(session.spec), result.nvfp4_paths or {})
            rows.append(latent_row(session, check.name, mode.value + suffix, count, result, reference, tol))
    return rows


def run_backends(session: Session, check: Check) -> list[CheckRow]:
    spec, dtype = session.spec, session.dtype
    rows: dict[str, list[CheckRow]] = {}
    runnable = []
    for backend in (b for b in BACKENDS if b != "sdpa"):
        try:
            check_backend(backend, spec.device, head_dim=spec.config.head_dim, dtype=spec_dtype(spec))
            runnable.append(backend)
        except BackendUnavailable as err:
            rows[backend] = [skipped(check.name, f"{backend} {what}", 1, dtype, str(err)) for what in ("attention", "latents")]
    if runnable:
        session.on_event("backends: " + ", ".join(runnable) + " vs sdpa")
        measures = session.side_by_side([(measure_backend_attention, (spec, backend)) for backend in runnable])
        runs = single_rank_runs(session, [REFERENCE] + [(Mode.ULYSSES, backend) for backend in runnable])
        for backend, attention in zip(runnable, measures):
            tol = backend_tolerance(backend, spec_dtype(spec))
            rows[backend] = [
                row_of(check.name, 1, "none", dtype, attention),
                latent_row(session, check.name, f"{backend} latents", 1, runs[(Mode.ULYSSES, backend)], runs[REFERENCE], tol),
            ]
    return [row for backend in BACKENDS if backend in rows for row in rows[backend]]
