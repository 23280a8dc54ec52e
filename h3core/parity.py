"""Parity: a distributed result compared with the single-rank result of the same inputs.

The product's core promise is the same latents at every rank count. Every comparison is printed
and recorded as numbers (max |a - b| and that over max |reference|), never only asserted.
Tolerances are per mode and dtype: Ulysses only moves data, so in float32 it should be exact and
is held to 1e-6; tensor mode sums row-parallel partials in a different order than one GEMM, so
float32 gets 1e-5. In bf16 the different summation orders are rounded to 8 bits of mantissa
and then fed back through every step, so the bounds are much wider.
"""

from __future__ import annotations

import torch
from pydantic import BaseModel

from h3core.plan import Mode
from h3core.report import ErrorStats

_TOLERANCE = {
    (Mode.ULYSSES, torch.float32): 1e-6,
    (Mode.TENSOR, torch.float32): 1e-5,
    (Mode.ULYSSES, torch.bfloat16): 2e-2,
    (Mode.TENSOR, torch.bfloat16): 5e-2,
    (Mode.ULYSSES, torch.float16): 1e-2,
    (Mode.TENSOR, torch.float16): 2e-2,
}


def tolerance(mode: Mode, dtype: torch.dtype) -> float:
    """Largest relative error (max |a-b| / max |ref|) that counts as parity for `mode` in `dtype`."""
    return _TOLERANCE[(mode, dtype)]


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
