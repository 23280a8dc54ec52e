"""The parity bounds are what their derivation says, and its inputs still hold on this machine:
one linear computed the distributed way is within `rounding_ulps(mode, dtype)` of the one-rank way, and ulp
noise on every linear grows by at most `AMPLIFICATION` (scripts/derive_parity_bounds.py measures
all presets and step counts; this re-measures the cheap part)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from h3core.generate import parity
from h3core.generate.parity import latent_parity
from h3core.parallel.modes import Mode
from h3core.runtime.device import cpu_threads

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "derive_parity_bounds.py"


@pytest.fixture(scope="module")
def derive():
    spec = importlib.util.spec_from_file_location("derive_parity_bounds", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("mode", list(Mode))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_each_bound_is_safety_times_amplification_times_rounding(mode, dtype):
    eps = torch.finfo(dtype).eps
    assert parity.tolerance(mode, dtype) == parity.SAFETY * parity.AMPLIFICATION * parity.rounding_ulps(mode, dtype) * eps
    assert parity.layer_tolerance(mode, dtype) == parity.SAFETY * parity.rounding_ulps(mode, dtype) * eps


def test_only_fp4_paths_rounded_to_16_bits_get_the_quantization_bound():
    fp32 = parity.tolerance(Mode.ULYSSES, torch.float32)
    assert parity.run_tolerance(Mode.ULYSSES, torch.float32, {"cpu-dequant": 4}) == fp32
    assert parity.run_tolerance(Mode.ULYSSES, torch.float32, {"cpu-fp4-emulated": 4}) == fp32  # fp32 GEMM output
    assert parity.run_tolerance(Mode.TENSOR, torch.bfloat16, {"cpu-fp4-emulated": 4}) == parity.FP4_HALF_TOLERANCE
    assert parity.run_tolerance(Mode.ULYSSES, torch.float32, {"cuda-fp4-scaled-mm": 4}) == parity.FP4_HALF_TOLERANCE  # bf16 out


def test_one_linear_rounds_within_the_assumed_units_here(derive, monkeypatch):
    monkeypatch.setattr(derive, "LENGTHS", (10, 97))
    with cpu_threads(1):  # as each rank of an 8-rank CPU World computes
        delta = derive.measure_delta(["tiny"])
    for mode in Mode:
        for name, dtype in derive.DTYPES.items():
            assert delta[mode.value][name] <= parity.rounding_ulps(mode, dtype), (mode, name, delta)


def test_ulp_noise_grows_by_at_most_the_assumed_amplification(derive):
    clean = derive.run_latents("tiny", 2, 3.0)
    noisy = derive.run_latents("tiny", 2, 3.0, perturb=(derive.PERTURBATION, 0))
    amplification = latent_parity(noisy, clean, 0.0, "clean").relative / derive.PERTURBATION
    assert 1 < amplification <= parity.AMPLIFICATION
