"""The fp4 GEMM self-test's decisions, proven on the CPU with injected GEMMs: h3's exact emulation
passes within the bound; a GEMM that returns zeros, NaNs or wrong values for some M (the reported
SM120 failure), or one that raises, refuses the fp4 path in one line naming the shape and the
fallback; the child process reports back and a child that dies refuses too, leaving the parent
alive; the verdict (a device's `DeviceKernels`) is what `choose_path` follows."""

from __future__ import annotations

import pytest
import torch

from h3core.nvfp4 import selftest
from h3core.nvfp4.kernels import DeviceKernels
from h3core.nvfp4.matmul import PATH_CUDA_BF16, PATH_CUDA_FP4, choose_path, emulated_scaled_mm_fp4
from h3core.nvfp4.selftest import FP4SelfTest, model_gemm_shapes, relative_bound, run_fp4_selftest, self_test

SHAPES = [(1, 32, 64), (77, 48, 96), (130, 64, 128)]  # a single row, a ragged M, more than one 128-row tile


def emulated(*args, **kwargs):
    return emulated_scaled_mm_fp4(*args, **kwargs)


def broken_at(m: int, how):
    """The emulation, except at M == m, where `how` rewrites its output (or raises)."""

    def gemm(a_packed, *args, **kwargs):
        out = emulated_scaled_mm_fp4(a_packed, *args, **kwargs)
        return how(out) if a_packed.shape[0] == m else out

    return gemm


def zero_rows_from(row: int):
    def how(out):
        out = out.clone()
        out[row:] = 0  # one tile of rows left unwritten: what "zeros for particular M" looks like
        return out

    return how


def raises(out):
    raise RuntimeError("CUDA error: an illegal memory access was encountered\nmore lines")


def test_the_exact_emulation_passes_well_inside_the_bound():
    result = self_test(SHAPES, emulated, "cpu")
    assert result.accepted and result.path == PATH_CUDA_FP4 and result.applicable
    assert all(c.verdict == "ok" and c.zero_outputs == 0 and c.nonfinite_outputs == 0 for c in result.checks)
    assert max(c.worst_over_bound for c in result.checks) < 0.25  # bf16 rounding (2^-9 at most) of a ~2% bound
    assert max(c.worst_relative_error for c in result.checks) <= 2.0**-8
    assert result.checks[2].checked_outputs == 48 * 48  # a slice, not the whole output, is compared


@pytest.mark.parametrize(
    "how, verdict, detail",
    [
        (lambda out: torch.zeros_like(out), "zeros", "3,696 of 3,696 outputs are zero"),
        (zero_rows_from(64), "zeros", "624 of 3,696 outputs are zero"),
        (lambda out: out.masked_fill(torch.rand(out.shape, generator=torch.Generator().manual_seed(0)) < 0.01, float("nan")), "nonfinite", "NaN or infinite"),
        (lambda out: out * 1.03, "wrong", "off by up to 0.03"),
        (lambda out: out.flip(0), "wrong", "checked outputs off by"),  # rows out of place
        (raises, "error", "RuntimeError: CUDA error: an illegal memory access was encountered"),
    ],
    ids=["all zeros", "zero rows", "NaNs", "3% off", "rows swapped", "raises"],
)
def test_a_gemm_broken_at_one_m_refuses_the_fp4_path(how, verdict, detail):
    result = self_test(SHAPES, broken_at(77, how), "cpu", device_name="NVIDIA RTX PRO 6000 Blackwell", capability=(12, 0))
    failed = [c for c in result.checks if c.verdict != "ok"]
    assert [c.m for c in failed] == [77] and failed[0].verdict == verdict, [c.detail for c in result.checks]
    assert detail in failed[0].detail
    assert not result.accepted and result.path == PATH_CUDA_BF16
    assert "\n" not in result.reason
    assert result.reason.startswith("fp4 GEMM self-test on NVIDIA RTX PRO 6000 Blackwell (sm_120) failed at (M, N, K) = (77, 48, 96)")
    assert result.reason.endswith("NVFP4 linears take cuda-dequant-bf16")


def test_the_bound_is_about_two_percent_and_an_error_inside_it_passes():
    assert 0.0195 < relative_bound(14336) < 0.0197 and relative_bound(64) < relative_bound(14336)
    assert self_test(SHAPES, broken_at(77, lambda out: out * 1.01), "cpu").accepted


def test_a_gemm_that_ignores_alpha_is_refused():
    def no_alpha(*args, a_global=None, b_global=None, **kwargs):
        return emulated_scaled_mm_fp4(*args, **kwargs)

    assert not self_test(SHAPES[:1], no_alpha, "cpu").accepted


def test_the_model_shapes_are_the_padded_gemm_shapes_at_every_rank_share():
    h3 = [(21504, 5376), (5376, 7168), (28672, 5376), (5376, 14336)]
    assert model_gemm_shapes(h3, [14855]) == [(14855, 5376, 7168), (14855, 5376, 14336), (14855, 21504, 5376), (14855, 28672, 5376)]
    shard = [(5376, 75 * 16)]  # a row-parallel out_proj shard with an odd block count
    assert model_gemm_shapes(shard, [1857, 1856, 0]) == [(1856, 5376, 1216), (1857, 5376, 1216)]


def test_the_child_process_reports_back(tmp_path):
    result = run_fp4_selftest(SHAPES[:2], "cpu", gemm="emulated")
    assert result.accepted and len(result.checks) == 2 and result.device == "cpu"


def test_a_child_that_dies_refuses_the_path_and_the_parent_lives(tmp_path, monkeypatch):
    """A CUDA fault (an illegal address) aborts the process that ran the kernel: here, the child."""
    (tmp_path / "fault_gemms.py").write_text("import os\n\ndef aborting(*args, **kwargs):\n    os.abort()\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    result = run_fp4_selftest(SHAPES[:1], "cpu", gemm="fault_gemms:aborting")
    assert not result.accepted and result.path == PATH_CUDA_BF16
    assert "the self-test process died (exit code -6" in result.reason and result.reason.endswith("NVFP4 linears take cuda-dequant-bf16")
    assert torch.ones(2).sum().item() == 2  # this process is fine


def test_choose_path_follows_the_devices_verdict():
    refused = self_test(SHAPES, broken_at(77, lambda out: out * 0), "cpu", device_name="GPU 3").model_copy(update={"device": "cuda:3"})
    kernels = DeviceKernels(torch.device("cuda", 3), (12, 0), fp4_verdict=lambda: None if refused.accepted else refused.reason)
    choice = choose_path("cuda", (12, 0), fp4_enabled=True, emulate_fp4=False, fp4_kernel_problem=kernels.fp4_gemm_problem)
    assert choice.path == PATH_CUDA_BF16 and "failed at (M, N, K) = (77, 48, 96)" in choice.reason


def test_without_a_record_the_child_runs_once_per_device_kernels(monkeypatch):
    calls = []

    def fake_run(shapes, device):
        calls.append(device)
        return FP4SelfTest(device=device, accepted=True, path=PATH_CUDA_FP4, reason="passed", bound="")

    monkeypatch.setattr(selftest, "run_fp4_selftest", fake_run)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (12, 0))
    kernels = DeviceKernels.of("cuda:1")  # no launcher record: the verdict is asked lazily, once
    assert calls == []
    assert kernels.fp4_gemm_problem() is None and kernels.fp4_gemm_problem() is None
    assert calls == ["cuda:1"]


def test_a_shape_the_gemm_cannot_take_is_a_caller_error():
    with pytest.raises(ValueError, match="N a multiple of 16, K of 32"):
        self_test([(4, 40, 64)], emulated, "cpu")


def test_the_command_without_a_gpu_says_so_and_exits_zero():
    """What `scripts/gpu_check.sh` gets on a machine with no fp4 GPU: a record, not a failure."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "h3core.nvfp4.selftest", "--device", "cuda:0", "--shapes", "1,32,64"], capture_output=True, text=True)
    result = FP4SelfTest.model_validate_json(done.stdout)
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert done.returncode == 0 and not result.applicable and not result.accepted
    assert result.reason == "fp4 GEMM not available on cuda:0: no CUDA device; NVFP4 linears take cuda-dequant-bf16"
