"""Parity: a distributed result compared with the single-rank result of the same inputs.

The product's core promise is the same latents at every rank count. Every comparison is printed
and recorded as numbers (max |a - b| and that over max |reference|), never only asserted.

The bounds are derived from measured rounding, not guessed (docs/verify.md has the derivation;
`scripts/derive_parity_bounds.py` re-measures every input and says whether these constants still
cover it):

    tolerance(mode, dtype) = SAFETY x AMPLIFICATION x delta(mode, dtype) x eps(dtype)

- delta: how far ONE linear computed the distributed way is from the one-rank way, relative to its
  largest output, in units of the dtype's eps; each mode says its own (`ParallelMode.rounding_ulps`).
  Ulysses: a GEMM on a rank's rows (fewer rows can take another CPU/cuBLAS kernel); tensor mode:
  row-parallel partials summed in another order.
- AMPLIFICATION: how much a relative perturbation of every linear's output grows by the final
  latents, through the blocks, the guidance and the sampler (one-rank runs, measured).
- SAFETY: 2, for prompts, seeds and counts the measurement did not cover. Each factor is already a
  worst case (delta: the largest element; A: every element perturbed at once).

The fp4 paths quantize activations: a rounding difference that moves one activation across an
E2M1 threshold changes it by a whole code step, and that grows into a difference as large as the
quantization noise itself (measured: one moved element, or 1e-7 noise on every linear output,
moves the latents by 0.07 to 0.4). In fp32 such a flip needs a ulp-sized input to sit within a
ulp of a threshold: the CPU emulation, measured at 2 to 8 ranks in both modes, never flipped and
keeps the fp32 bound. Where the fp4 GEMM rounds to a 16-bit type (cuBLAS's NVFP4 GEMM returns
bf16; emulated runs in bf16/fp16) flips are routine: two correct runs then differ by up to twice
the quantization noise, `FP4_HALF_TOLERANCE`. That bound detects only gross errors; the sharp
check of the fp4 path is the fp32 emulation (tests/dist).
"""

from __future__ import annotations

from typing import Iterable

import torch
from pydantic import BaseModel

from h3core.parallel.modes import Mode, mode_of
from h3core.reports.schema import ErrorStats

SAFETY = 2.0

AMPLIFICATION = 16.0
"""Measured 0.94 to 4.81 on MiniMax-H3's structure (tiny and narrow, 2 and 4 forwards; guidance 1:
<= 1.19, guidance 3: <= 4.81; `scripts/derive_parity_bounds.py`); kept at 16 for the widths, prompts
and step counts the measurement did not cover."""

FP4_QUANTIZATION_NOISE = 0.5
"""Relative latent difference of the fp4 path from the weight-only path at one rank (measured
0.012 to 0.014 without guidance, up to 0.043 with guidance 3, on MiniMax-H3's structure; kept at
0.5, as measured on wider activations before)."""

FP4_HALF_TOLERANCE = 2 * FP4_QUANTIZATION_NOISE
"""Two fp4 runs whose activation codes flipped apart are each within the quantization noise of the
weight-only result, so within twice it of each other (triangle inequality; the noise already
rounded up from its largest measurement)."""

_FP4_PATHS = ("cuda-fp4-scaled-mm", "cpu-fp4-emulated")
_HALF = (torch.bfloat16, torch.float16)


def rounding_ulps(mode: Mode, dtype: torch.dtype) -> float:
    """delta: one linear computed `mode`'s way vs one rank's, in eps of `dtype` (the mode says)."""
    return mode_of(mode).rounding_ulps(dtype.itemsize)


def tolerance(mode: Mode, dtype: torch.dtype) -> float:
    """Largest relative error (max |a-b| / max |ref|) that counts as parity for `mode` in `dtype`."""
    return SAFETY * AMPLIFICATION * rounding_ulps(mode, dtype) * torch.finfo(dtype).eps


def layer_tolerance(mode: Mode, dtype: torch.dtype) -> float:
    """The bound for ONE layer computed the distributed way (h3 verify's layer checks): one rounding
    source, nothing to amplify it: SAFETY x delta x eps."""
    return SAFETY * rounding_ulps(mode, dtype) * torch.finfo(dtype).eps


def run_tolerance(mode: Mode, dtype: torch.dtype, nvfp4_paths: Iterable[str]) -> float:
    """The bound for a run that took `nvfp4_paths`: `FP4_HALF_TOLERANCE` where an fp4 path rounded
    its GEMM to 16 bits (cuBLAS's fp4 GEMM always does; the emulation in a 16-bit run), else `tolerance`."""
    paths = set(nvfp4_paths)
    if "cuda-fp4-scaled-mm" in paths or (paths & set(_FP4_PATHS) and dtype in _HALF):
        return max(FP4_HALF_TOLERANCE, tolerance(mode, dtype))
    return tolerance(mode, dtype)


class LatentParity(BaseModel):
    """Final latents of a run vs the single-rank run with the same seed and prompt."""

    reference: str
    video: ErrorStats | None
    audio: ErrorStats | None
    max_abs: float
    relative: float
    bitwise: bool
    tolerance: float
    passed: bool


def latent_parity(
    result: dict[str, torch.Tensor | None], reference: dict[str, torch.Tensor | None], tol: float, reference_name: str
) -> LatentParity:
    """Compare `{'video': ..., 'audio': ...}` latents with the reference's."""
    stats = {k: ErrorStats.between(result[k], reference[k]) if reference.get(k) is not None else None for k in ("video", "audio")}
    present = [s for s in stats.values() if s is not None]
    max_abs = max((s.max_abs for s in present), default=0.0)
    relative = max((s.relative for s in present), default=0.0)
    bitwise = all(torch.equal(result[k], reference[k]) for k in ("video", "audio") if reference.get(k) is not None)
    return LatentParity(
        reference=reference_name,
        video=stats["video"],
        audio=stats["audio"],
        max_abs=max_abs,
        relative=relative,
        bitwise=bitwise,
        tolerance=tol,
        passed=relative <= tol,
    )
