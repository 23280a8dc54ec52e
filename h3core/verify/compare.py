"""Rank-side helpers of the checks: seeded inputs that every rank builds identically, the model of
the spec, and the comparison of a result with its reference as a `Measure`."""

from __future__ import annotations

import math

import torch

from h3core.model.checkpoint import Checkpoint
from h3core.model.dit import H3Model
from h3core.reports.schema import error_between
from h3core.runtime.device import compute_dtype
from h3core.verify.rows import Measure
from h3core.verify.spec import VerifySpec


def spec_dtype(spec: VerifySpec) -> torch.dtype:
    return compute_dtype(spec.device, spec.dtype)


def seeded(shape: tuple[int, ...], seed: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Standard-normal values from a CPU generator (the same on every rank and device), then moved."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(device=device, dtype=dtype)


def load_model(spec: VerifySpec, device: torch.device, skip: tuple[str, ...] = ()) -> H3Model:
    """The spec's synthetic checkpoint through the real loader (NVFP4 linears stay packed)."""
    return Checkpoint.open(spec.checkpoint, spec.config).load(device=device, dtype=spec_dtype(spec), skip=skip)


def measure(variant: str, result: torch.Tensor, reference: torch.Tensor, tolerance: float, worst: str = "") -> Measure:
    """max |result - reference| and max |reference| (`h3core.reports.schema.error_between`, the one error
    metric), as this rank's `Measure`; a shape mismatch is a mismatch, not a number."""
    if result.shape != reference.shape:
        return Measure(
            variant=variant, max_abs=math.inf, scale=0.0, tolerance=tolerance,
            mismatches=[f"{worst or variant}: shape {list(result.shape)} vs reference {list(reference.shape)}"],
        )
    diff, scale = error_between(result, reference)
    return Measure(variant=variant, max_abs=diff, scale=scale, tolerance=tolerance, worst=worst)


def measure_all(variant: str, pairs: list[tuple[str, torch.Tensor, torch.Tensor]], tolerance: float) -> Measure:
    """One `Measure` over several (case, result, reference) comparisons: the worst case wins."""
    total = None
    for case, result, reference in pairs:
        one = measure(variant, result, reference, tolerance, worst=case)
        total = one if total is None else total.merged(one)
    assert total is not None, "measure_all needs at least one comparison"
    return total
