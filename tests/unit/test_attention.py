"""Attention: `sdpa` takes a fused kernel at h3's shapes and dtypes (a fallback to math raises), the
record names the kernel the real call's tensors dispatch to, and optional backends are refused
before any rank starts with one line naming what to install."""

from __future__ import annotations

import sys
import types

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from h3core.errors import BackendUnavailable
from h3core.model import attention
from collections import Counter

from h3core.model.attention import AttentionKernel, attend, check_backend, checks

FUSED_CPU = [SDPBackend.FLASH_ATTENTION]
"""The CPU's only fused SDPA kernel; under this context a call that would need math raises."""


def model_like_qkv(tokens: int, heads: int, head_dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """q, k, v as the model hands them over: q, k fresh [S, H, Dh] (after RoPE), v a strided view of
    the fused QKV output (`unflatten(...).unbind(1)`)."""
    gen = torch.Generator().manual_seed(tokens + heads)
    qkv = torch.randn(tokens, 3 * heads * head_dim, generator=gen).to(dtype)
    q, k, v = qkv.unflatten(-1, (3, heads, head_dim)).unbind(1)  # [S, H, Dh] views
    return q.contiguous(), k.contiguous(), v


# H3: 56 heads x 128 (7 per rank at 8 ranks); the CPU presets' head width 16; bf16/fp16 as on GPUs.
@pytest.mark.filterwarnings("ignore:.*(kernel not used|4 dimensional)")  # the 3-D call's own complaint
@pytest.mark.parametrize("heads, head_dim", [(56, 128), (7, 128), (8, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_sdpa_runs_a_fused_kernel_at_h3_shapes(heads, head_dim, dtype):
    q, k, v = model_like_qkv(40, heads, head_dim, dtype)
    with sdpa_kernel(FUSED_CPU):
        out = attend(q, k, v, "sdpa")  # a math fallback would raise "No available kernel"
        with pytest.raises(RuntimeError, match="No available kernel"):  # the old 3-D call did fall back
            F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1))
    reference = attend(q, k, v, "math")
    assert out.shape == q.shape and out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert ((out.float() - reference.float()).abs().max() / reference.float().abs().max()).item() < tol


def test_the_model_runs_sdpa_fused_end_to_end():
    """A whole one-rank run of the tiny preset with math forbidden: every attention call is fused."""
    from h3core.generate.request import GenerateRequest, resolve
    from h3core.generate.run import one_rank_latents

    from h3core.generate.run import execute

    run = resolve(GenerateRequest(preset="tiny", steps=2))
    with sdpa_kernel(FUSED_CPU):
        (outcome,) = execute(run)
    assert torch.isfinite(outcome.latents["video"]).all()
    assert outcome.attention_kernels == {"sdpa:flash_attention": run.config.num_blocks}  # the rank's record of its one forward


def test_the_record_names_what_the_call_dispatched_to():
    q, k, v = model_like_qkv(24, 4, 16, torch.float32)
    record: Counter[str] = Counter()
    attend(q, k, v, "sdpa", record)
    attend(q, k, v, "sdpa", record)
    with sdpa_kernel([SDPBackend.MATH]):  # the flags are part of the decision: math is recorded as math
        attend(q, k, v, "sdpa", record)
    attend(q, k, v, "math", record)
    attend(q, k, v, "math")  # no record given: counted nowhere
    assert record == {"sdpa:flash_attention": 2, "sdpa:math": 1, "h3 math (fp32 softmax)": 1}
    assert attention.is_math_kernel("sdpa:math") and not attention.is_math_kernel("sdpa:flash_attention")


def test_the_decision_is_taken_on_the_real_tensors_not_a_probe(monkeypatch):
    seen = []
    real = torch._fused_sdp_choice

    def spy(q, k, v, *args, **kwargs):
        seen.append((tuple(q.shape), q.stride()))
        return real(q, k, v, *args, **kwargs)

    monkeypatch.setattr(torch, "_fused_sdp_choice", spy)
    q, k, v = model_like_qkv(33, 3, 16, torch.float32)
    kernel = AttentionKernel("sdpa")  # the model's: it keeps its decisions
    kernel.record = Counter()
    kernel(q, k, v)
    kernel(q, k, v)  # same signature: decided once
    assert seen == [((1, 3, 33, 16), q.transpose(0, 1).unsqueeze(0).stride())]


# --- optional backends: refused before any rank starts -----------------------------------------------


def fake_module(monkeypatch, name: str, version: str | None, **attrs) -> None:
    module = types.ModuleType(name)
    for key, value in attrs.items():
        setattr(module, key, value)
    monkeypatch.setitem(sys.modules, name, module)
    real_version = checks.importlib.metadata.version

    def version_of(dist: str) -> str:
        if dist.replace("-", "_") == name:
            if version is None:
                raise checks.importlib.metadata.PackageNotFoundError(dist)
            return version
        return real_version(dist)

    monkeypatch.setattr(checks.importlib.metadata, "version", version_of)


H100, B200, RTX5090 = (9, 0), (10, 0), (12, 0)


@pytest.mark.parametrize(
    "version, capability, head_dim, dtype, message",
    [
        ("1.0.6", H100, 128, torch.bfloat16, "needs SageAttention 2, but sageattention 1.0.6 is installed"),
        ("2.2.0", B200, 128, torch.bfloat16, r"does not run on this GPU \(sm_100"),
        ("2.2.0", H100, 256, torch.bfloat16, "head widths up to 128"),
        ("2.2.0", H100, 128, torch.float32, "fp16 or bf16 only, not float32"),
    ],
)
def test_sage2_is_refused_with_what_to_do(monkeypatch, version, capability, head_dim, dtype, message):
    fake_module(monkeypatch, "sageattention", version, sageattn=lambda *a, **k: None)
    with pytest.raises(BackendUnavailable, match=message) as err:
        check_backend("sage2", "cuda", head_dim=head_dim, dtype=dtype, capability=capability)
    assert "\n" not in str(err.value) and ("sdpa" in str(err.value) or "install" in str(err.value))


def test_sage2_2_passes_where_it_runs(monkeypatch):
    fake_module(monkeypatch, "sageattention", "2.2.0", sageattn=lambda *a, **k: None)
    for capability in (H100, RTX5090, (8, 9)):
        check_backend("sage2", "cuda", head_dim=128, dtype=torch.bfloat16, capability=capability)
    with pytest.raises(BackendUnavailable, match="runs on CUDA only"):
        check_backend("sage2", "cpu", head_dim=128, dtype=torch.bfloat16)


def test_flash_without_flash_attn_func_is_refused(monkeypatch):
    fake_module(monkeypatch, "flash_attn", "4.0.0")  # a FlashAttention 4 install: no flash_attn_func
    with pytest.raises(BackendUnavailable, match="has no `flash_attn_func`.*pip install flash-attn"):
        check_backend("flash", "cuda", head_dim=128, dtype=torch.bfloat16, capability=H100)


@pytest.mark.parametrize(
    "capability, head_dim, dtype, message",
    [
        (H100, 128, torch.float32, "fp16 or bf16 only"),
        ((7, 5), 128, torch.bfloat16, "compute capability 8.0 or newer"),
        (H100, 100, torch.bfloat16, "multiples of 8 up to 256"),
    ],
)
def test_flash_is_refused_where_it_cannot_run(monkeypatch, capability, head_dim, dtype, message):
    fake_module(monkeypatch, "flash_attn", "2.8.3", flash_attn_func=lambda *a, **k: None)
    with pytest.raises(BackendUnavailable, match=message):
        check_backend("flash", "cuda", head_dim=head_dim, dtype=dtype, capability=capability)
    check_backend("flash", "cuda", head_dim=128, dtype=torch.bfloat16, capability=H100)


def test_generate_refuses_fp32_with_flash_before_spawning(monkeypatch):
    from h3core.generate.request import GenerateRequest, resolve

    fake_module(monkeypatch, "flash_attn", "2.8.3", flash_attn_func=lambda *a, **k: None)
    monkeypatch.setattr(checks, "_gpu_capability", lambda: H100)
    with pytest.raises(BackendUnavailable, match="fp16 or bf16 only, not float32; drop --dtype fp32"):
        resolve(GenerateRequest(attention="flash", device="cuda", dtype="fp32", world_size=4))
