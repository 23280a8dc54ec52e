"""The fp4 GEMM self-test and the fused activation quantizer on a real GPU. Skipped without CUDA;
the GEMM checks need compute capability >= 10 (Blackwell). Run tests/gpu in a pytest session of
its own (the unit tier imports triton for its interpreter)."""

from __future__ import annotations

import pytest
import torch

from h3core.nvfp4 import activation
from h3core.nvfp4.activation import eager_quantize_activation, fused_quantize_activation, quantize_activation
from h3core.nvfp4.codec import global_scale_for
from h3core.nvfp4.matmul import scaled_mm_fp4
from h3core.nvfp4.selftest import DEFAULT_SHAPES, model_gemm_shapes, run_fp4_selftest, self_test

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CUDA = torch.device("cuda", 0)


def blackwell() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability(CUDA) >= (10, 0) and hasattr(torch, "float4_e2m1fn_x2")


needs_fp4 = pytest.mark.skipif(not blackwell(), reason="the fp4 GEMM needs compute capability >= 10 (Blackwell)")
H3 = [(21504, 5376), (5376, 7168), (28672, 5376), (5376, 14336)]


@needs_fp4
def test_the_production_gemm_passes_at_h3_shapes_in_process():
    shapes = list(DEFAULT_SHAPES) + model_gemm_shapes(H3, [1857, 14855])
    result = self_test(shapes, scaled_mm_fp4, CUDA, device_name=torch.cuda.get_device_name(CUDA), capability=torch.cuda.get_device_capability(CUDA))
    assert result.accepted, result.reason
    print(result.reason, [round(c.worst_relative_error, 5) for c in result.checks])


def test_the_child_process_gives_a_verdict_on_this_gpu():
    result = run_fp4_selftest(DEFAULT_SHAPES, "cuda:0")
    assert result.accepted == blackwell(), result.reason
    assert result.applicable == blackwell() or result.accepted


def triton_for_this_gpu() -> bool:
    if not torch.cuda.is_available() or not activation.triton_available():  # no GPU: leave triton unimported
        return False
    import triton.language as tl

    return type(tl.max).__name__ != "InterpretedFunction"


needs_triton = pytest.mark.skipif(not triton_for_this_gpu(), reason="needs triton built for the GPU (not the interpreter)")


@needs_triton
@pytest.mark.parametrize("rows, width", [(3, 208), (1857, 5376), (1857, 7168), (1857, 14336), (14855, 5376)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_fused_quantizer_on_the_gpu_is_the_eager_codec(rows, width, dtype):
    gen = torch.Generator().manual_seed(rows + width)
    x = (torch.randn(rows, width, generator=gen) * torch.logspace(-3, 2, width)).to(CUDA, dtype)
    x[0, :16] = 0
    gs = global_scale_for(x)
    padded = -(-width // 32) * 32
    want_packed, want_scales = eager_quantize_activation(x, gs, padded)
    got_packed, got_scales = fused_quantize_activation(x, gs, padded)
    assert torch.equal(got_packed, want_packed)
    assert torch.equal(got_scales.view(torch.uint8), want_scales.view(torch.uint8))


@needs_triton
def test_quantize_activation_takes_the_fused_kernel_on_cuda(monkeypatch):
    def refuse(*args):
        raise AssertionError("the eager codec ran on CUDA")

    monkeypatch.setattr(activation, "eager_quantize_activation", refuse)
    packed, scales = quantize_activation(torch.randn(5, 64, device=CUDA), torch.tensor(0.01, device=CUDA), 64)
    assert packed.shape == (5, 32)
