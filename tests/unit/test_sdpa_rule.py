"""h3's rule for SDPA on CUDA: which fused kernels a call may take, as a pure function of (torch,
cuDNN, capability, dtype, head width, length), the CUDA call running under exactly that choice (the
mechanism proven on the CPU with an injected choice), and `gpu_check.sh` failing on a kernel the
rule refuses."""

from __future__ import annotations

import json
import types

from collections import Counter

import pytest
import torch

from h3core.errors import BackendUnavailable
from h3core.model.attention import SdpaChoice, SdpaChoices, attend, check_backend, choose_sdpa_backends
from h3core.nvfp4.kernels import DeviceKernels
from h3core.verify import gpu_reports

H100, B200, B300, RTX_PRO_6000, A100, L40S = (9, 0), (10, 0), (10, 3), (12, 0), (8, 0), (8, 9)
H3_LENGTH = 128 + 147 + 14580  # text + audio + video rows at 864x480x141: not a multiple of 128
CUDNN_FIRST = ("cudnn_attention", "flash_attention", "efficient_attention")
NO_CUDNN = ("flash_attention", "efficient_attention")


def rule(torch_version="2.13.0+cu130", cudnn=92000, capability=H100, dtype=torch.bfloat16, head_dim=128, seq_len=H3_LENGTH):
    return choose_sdpa_backends(
        torch_version=torch_version, cudnn_version=cudnn, capability=capability, dtype=dtype, head_dim=head_dim, seq_len=seq_len
    )


@pytest.mark.parametrize(
    "case, kwargs, backends",
    [
        ("H200, fixed cuDNN: cuDNN first, as PyTorch", {}, CUDNN_FIRST),
        ("B200", {"capability": B200}, CUDNN_FIRST),
        ("B300", {"capability": B300}, CUDNN_FIRST),
        ("RTX PRO 6000: cuDNN not enabled on sm_120", {"capability": RTX_PRO_6000}, NO_CUDNN),
        ("A100", {"capability": A100}, NO_CUDNN),
        ("torch 2.9.1's cuDNN 9.10.2 at H3's length", {"torch_version": "2.9.1+cu128", "cudnn": 91002}, NO_CUDNN),
        ("cuDNN 9.15.0 at H3's length", {"cudnn": 91500}, NO_CUDNN),
        ("cuDNN 9.15.1 at H3's length", {"cudnn": 91501}, CUDNN_FIRST),
        ("cuDNN 9.10.2 at a multiple of 128", {"cudnn": 91002, "seq_len": 14848}, CUDNN_FIRST),
        ("unknown cuDNN", {"cudnn": None}, NO_CUDNN),
        ("fp32: efficient only", {"dtype": torch.float32}, ("efficient_attention",)),
        ("fp16", {"dtype": torch.float16}, CUDNN_FIRST),
        ("head_dim 256: no cuDNN", {"head_dim": 256}, NO_CUDNN),
        ("head_dim 100 in bf16: nothing fused", {"head_dim": 100}, ()),
        ("head_dim 100 in fp32: efficient", {"head_dim": 100, "dtype": torch.float32}, ("efficient_attention",)),
        ("sm_75 in bf16: efficient only", {"capability": (7, 5)}, ("efficient_attention",)),
        ("sm_35: nothing", {"capability": (3, 5)}, ()),
    ],
)
def test_the_rule(case, kwargs, backends):
    choice = rule(**kwargs)
    assert choice.backends == backends, (case, choice.reason)
    assert "math" not in " ".join(choice.backends)  # never the unfused kernel on a GPU
    assert "\n" not in choice.reason


def test_the_cudnn_version_boundary_is_9_15_1_exactly():
    """Mutation guard: 9.15.0 (91500) is refused at H3's length and 9.15.1 (91501) allowed; both
    are allowed at a multiple of 128, which the bug never touched."""
    assert "cudnn_attention" not in rule(cudnn=91500).backends
    assert "cudnn_attention" in rule(cudnn=91501).backends
    assert "cudnn_attention" in rule(cudnn=91500, seq_len=128 * 116).backends
    assert "169849" in rule(cudnn=91500).reason and "9.15.0 < 9.15.1" in rule(cudnn=91500).reason


@pytest.mark.parametrize(
    "torch_version, cudnn, capability, prefers",
    [
        ("2.9.1+cu128", 91002, H100, True),  # the exposed default: cuDNN first at any length
        ("2.9.0", 90800, H100, False),
        ("2.10.0+cu129", 91002, H100, False),  # PR 171627: off below 9.15.1
        ("2.10.0+cu130", 91501, H100, True),
        ("2.13.0", 92000, RTX_PRO_6000, False),
        ("2.13.0", 92000, B300, True),
        ("2.8.0", 91002, H100, False),
        ("2.11.0.dev20260101+cu130", 91600, B200, True),
    ],
)
def test_what_torch_itself_would_prefer(torch_version, cudnn, capability, prefers):
    assert rule(torch_version=torch_version, cudnn=cudnn, capability=capability).torch_default_prefers_cudnn is prefers


def test_h3_overrides_torch_2_9_where_it_would_take_the_broken_kernel():
    choice = rule(torch_version="2.9.1+cu128", cudnn=91002, capability=H100)
    assert choice.torch_default_prefers_cudnn and "cudnn_attention" not in choice.backends


def test_the_cuda_call_runs_under_the_choice(monkeypatch):
    """On the CPU the only SDPA kernels are flash and math: a choice of math-only, injected where a
    CUDA call gets its choice, must reach both the record and the call (the default takes flash)."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(40, 4, 16, generator=gen) for _ in range(3))
    record: Counter[str] = Counter()
    fused = attend(q, k, v, "sdpa", record)
    forced = SdpaChoice(("math",), "injected", False)

    class Forced(SdpaChoices):  # what a CUDA call's choices answer, here on the CPU
        def rule(self, q4):
            return forced

    restricted = attend(q, k, v, "sdpa", record, Forced())
    assert record == {"sdpa:flash_attention": 1, "sdpa:math": 1}
    assert torch.allclose(fused, restricted, atol=1e-5)
    assert torch.backends.cuda.flash_sdp_enabled()  # the restriction ends with the call


def test_a_cuda_call_with_no_fused_kernel_is_refused_not_run_as_math():
    choices = SdpaChoices(DeviceKernels(torch.device("cuda", 0), (3, 5)))  # the GPU's facts, as its loader gives them
    q4 = types.SimpleNamespace(device=torch.device("cuda", 0), dtype=torch.bfloat16, shape=(1, 2, 8, 16))  # what it reads
    with pytest.raises(BackendUnavailable, match="no fused kernel here.*sm_35"):
        choices.rule(q4)


def test_check_backend_refuses_sdpa_before_the_run_where_nothing_fused_fits():
    with pytest.raises(BackendUnavailable, match="has no fused kernel here"):
        check_backend("sdpa", "cuda", head_dim=128, dtype=torch.float32, capability=(3, 5))
    check_backend("sdpa", "cuda", head_dim=128, dtype=torch.bfloat16, capability=H100)
    check_backend("sdpa", "cpu", head_dim=100, dtype=torch.float32)


def test_the_rule_for_a_report_uses_its_dtype_width_and_length(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: H100)
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 91002)
    path = tmp_path / "generate.json"
    path.write_text(json.dumps({"dtype": "bf16", "config": {"head_dim": 128}, "num_tokens": H3_LENGTH}))
    verdict = json.loads(gpu_reports.sdpa_rule_for_report(path))
    assert verdict["allowed"] == ["sdpa:flash_attention", "sdpa:efficient_attention"]


def test_gpu_check_fails_on_a_kernel_the_rule_refuses(tmp_path, capsys):
    ranks = [{"rank": r, "attention_kernels": {k: 8}, "nvfp4_paths": {"cuda-dequant-bf16": 96}} for r, k in enumerate(["sdpa:flash_attention", "sdpa:cudnn_attention"])]
    report = {"ranks": ranks, "parity": None}
    verdict = {"allowed": ["sdpa:flash_attention", "sdpa:efficient_attention"], "reason": rule(cudnn=91002).reason}
    problems = gpu_reports.generate_problems(report, "cuda-dequant-bf16", verdict)
    assert len(problems) == 1 and "rank 1: attention ran sdpa:cudnn_attention, which h3's rule refuses here" in problems[0]
    assert gpu_reports.generate_problems(report, "cuda-dequant-bf16") == []  # without the rule: fused is all it checks
    (tmp_path / "generate.json").write_text(json.dumps(report))
    (tmp_path / "rule.json").write_text(json.dumps(verdict))
    assert gpu_reports.main([str(tmp_path), "cuda-dequant-bf16", str(tmp_path / "rule.json")]) == 1
    assert "which h3's rule refuses here" in capsys.readouterr().out


def test_sdp_backends_name_real_enum_members():
    from torch.nn.attention import SDPBackend

    assert rule().sdp_backends == [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
    assert rule().kernels == ("sdpa:cudnn_attention", "sdpa:flash_attention", "sdpa:efficient_attention")  # the record's names
