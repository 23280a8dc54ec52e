"""The conclusions scripts/gpu_check.sh draws from its reports, checked on the CPU with real
report shapes: a math attention kernel or another NVFP4 path on any rank fails the check."""

from __future__ import annotations

import json

import pytest

from h3core.verify import gpu_reports

FP4, BF16 = "cuda-fp4-scaled-mm", "cuda-dequant-bf16"


def generate_report(kernels_per_rank, paths_per_rank, parity=None):
    ranks = [
        {"rank": r, "attention_kernels": k, "nvfp4_paths": p, "peak_memory_sampling_bytes": 1}
        for r, (k, p) in enumerate(zip(kernels_per_rank, paths_per_rank))
    ]
    return {"ranks": ranks, "parity": parity}


def test_fused_kernels_and_the_expected_path_on_every_rank_pass():
    report = generate_report([{"sdpa:flash_attention": 8}] * 4, [{FP4: 96}] * 4, {"passed": True, "relative": 0.1, "tolerance": 1.0})
    assert gpu_reports.generate_problems(report, FP4) == []


@pytest.mark.parametrize(
    "kernels, paths, expected, problem",
    [
        ([{"sdpa:flash_attention": 8}, {"sdpa:math": 8}], [{BF16: 96}] * 2, BF16, "rank 1: attention ran sdpa:math"),
        ([{"h3 math (fp32 softmax)": 8}], [{BF16: 96}], BF16, "rank 0: attention ran h3 math"),
        ([{"sdpa:efficient_attention": 8}] * 2, [{FP4: 96}, {FP4: 90, BF16: 6}], FP4, "rank 1: NVFP4 paths"),
        ([{"sdpa:flash_attention": 8}], [{BF16: 96}], FP4, "expected only cuda-fp4-scaled-mm"),
        ([{}], [{BF16: 96}], BF16, "no attention kernel recorded"),
    ],
)
def test_an_unfused_kernel_or_a_wrong_path_on_any_rank_is_a_problem(kernels, paths, expected, problem):
    problems = gpu_reports.generate_problems(generate_report(kernels, paths), expected)
    assert any(problem in p for p in problems), problems


def test_failed_parity_and_missing_reports_are_problems(tmp_path):
    report = generate_report([{"sdpa:flash_attention": 1}], [{BF16: 1}], {"passed": False, "relative": 0.3, "tolerance": 0.25})
    assert gpu_reports.generate_problems(report, BF16) == ["generate: parity 0.3 > tolerance 0.25"]
    assert gpu_reports.linear_bench_problems({"rows": [{"name": "fc2", "path": BF16}]}, FP4) == ["nvfp4-linear fc2: path cuda-dequant-bf16, expected cuda-fp4-scaled-mm"]
    (tmp_path / "generate.json").write_text("{not json")  # e.g. a warning written into the JSON
    assert gpu_reports.main([str(tmp_path), BF16]) == 1


def test_a_clean_check_exits_zero(tmp_path, capsys):
    rows = [{"name": "fc2", "shape": "10752->7168", "dense_tflops": 700.0, "nvfp4_tflops": 1500.0, "path": FP4}]
    (tmp_path / "nvfp4-linear.json").write_text(json.dumps({"rows": rows}))
    report = generate_report([{"sdpa:flash_attention": 8}], [{FP4: 96}], {"passed": True, "relative": 0.1, "tolerance": 1.0})
    report.update(timings={"sampling": 2.0}, step_seconds=[0.5, 0.5], config={"name": "h3-2blocks"}, world_size=1,
                  device_name="NVIDIA B200", attention_kernel="sdpa:flash_attention", nvfp4_path=FP4)
    (tmp_path / "generate.json").write_text(json.dumps(report))
    assert gpu_reports.main([str(tmp_path), FP4]) == 0
    assert "checks: all passed" in capsys.readouterr().out
