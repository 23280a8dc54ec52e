"""NVFP4 on CUDA: decode/encode agree with the CPU bit for bit, the bf16 path, and the fp4 _scaled_mm path.

Skipped without CUDA; the fp4 GEMM tests also need compute capability >= 10 (Blackwell).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from h3core.nvfp4.codec import NVFP4Weight, dequantize, global_scale_for, quantize
from h3core.nvfp4.linear import NVFP4Linear
from h3core.nvfp4.matmul import PATH_CUDA_BF16, PATH_CUDA_FP4, dequant_linear
from h3core.nvfp4.kernels import DeviceKernels
from h3core.nvfp4.shard import row_parallel
from h3core.parallel.partition import nvfp4_column_slices

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CUDA = torch.device("cuda", 0)


def blackwell() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability(CUDA) >= (10, 0)


needs_fp4 = pytest.mark.skipif(not blackwell(), reason="the fp4 GEMM needs compute capability >= 10 (Blackwell)")


def make_linear(out: int, inp: int, seed: int = 0) -> NVFP4Linear:
    gen = torch.Generator().manual_seed(seed)
    # rows of very different magnitudes: block scales vary a lot, so a misplaced scale shows
    weight = torch.randn(out, inp, generator=gen) * torch.logspace(-2, 1, out).unsqueeze(1)
    return NVFP4Linear.from_float(weight, torch.randn(out, generator=gen))


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def test_decode_on_cuda_is_bit_exact_with_the_cpu():
    finite = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)
    gen = torch.Generator().manual_seed(1)
    packed = torch.randint(0, 256, (512, 256), dtype=torch.uint8, generator=gen)
    scale = finite[torch.randint(0, len(finite), (512, 32), generator=gen)].view(torch.float8_e4m3fn)
    w = NVFP4Weight(packed, scale, torch.tensor(0.0037))
    on_cpu, on_cuda = dequantize(w), dequantize(w.to(CUDA)).cpu()
    assert torch.equal(on_cuda.view(torch.int32), on_cpu.view(torch.int32))


def test_quantize_on_cuda_is_bit_exact_with_the_cpu():
    weight = torch.randn(384, 512, generator=torch.Generator().manual_seed(2))
    weight[0, :16] = 0
    a, b = quantize(weight), quantize(weight.to(CUDA))
    assert torch.equal(b.packed.cpu(), a.packed)
    assert torch.equal(b.scale.cpu().view(torch.uint8), a.scale.view(torch.uint8))
    assert torch.equal(b.global_scale.cpu(), a.global_scale)


def test_bf16_path_matches_the_dense_reference():
    linear = make_linear(384, 512).to(CUDA)
    linear.fp4_matmul = False
    assert linear.path == PATH_CUDA_BF16
    x = torch.randn(77, 512, device=CUDA, dtype=torch.bfloat16)
    want = F.linear(x.float(), dequantize(linear.nvfp4), linear.bias)
    got = linear(x)
    assert got.dtype == torch.bfloat16 and got.shape == (77, 384)
    assert relative_error(got, want) < 1e-2


def test_float32_input_comes_back_float32_on_the_bf16_path():
    linear = make_linear(64, 128).to(CUDA)
    linear.fp4_matmul = False
    x = torch.randn(4, 128, device=CUDA)
    y = linear(x)
    assert y.dtype == torch.float32 and y.shape == (4, 64)
    # the values are the bf16 product (inputs rounded to bf16, fp32 accumulation), cast back: close to
    # the fp32 reference within bf16 rounding, and equal to what the bf16 path gives bf16 input
    want = F.linear(x.float(), dequantize(linear.nvfp4), linear.bias)
    assert relative_error(y, want) < 1e-2
    assert torch.equal(y, linear(x.bfloat16()).float())


def test_chunked_dequant_bounds_peak_memory():
    out, inp = 8192, 4096  # a 64 MiB bf16 weight
    w = quantize(torch.randn(out, inp)).to(CUDA)
    x = torch.randn(16, inp, device=CUDA, dtype=torch.bfloat16)
    dequant_linear(x, w, None, chunk_elements=1 << 20)  # warm-up: cuBLAS workspace, lookup tables
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    y = dequant_linear(x, w, None, chunk_elements=1 << 20)  # 1M-element chunks: 256 rows
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    dense_bf16 = out * inp * 2
    assert extra < dense_bf16 // 4, f"peak {extra >> 20} MiB above the inputs; the bf16 weight is {dense_bf16 >> 20} MiB"
    full = dequant_linear(x, w, None)
    assert relative_error(y, full) < 1e-3


def test_row_parallel_partials_sum_to_the_full_product_on_cuda():
    full = make_linear(256, 13 * 16, 3).to(CUDA)
    full.fp4_matmul = False
    x = torch.randn(33, full.in_features, device=CUDA, dtype=torch.bfloat16)
    total = torch.zeros(33, 256, device=CUDA)
    for cols in nvfp4_column_slices(full.in_features, 5):
        shard, bias = row_parallel(full, cols)
        shard.fp4_matmul = False
        total += shard(x[:, cols.elements.start : cols.elements.stop]).float()
    total += bias
    assert relative_error(total, full(x)) < 1e-2


@pytest.mark.skipif(blackwell(), reason="checks the pre-Blackwell choice")
def test_pre_blackwell_takes_the_bf16_path():
    assert make_linear(384, 512).to(CUDA).path == PATH_CUDA_BF16


@needs_fp4
def test_fp4_kernel_is_available_on_blackwell():
    assert DeviceKernels.of(CUDA).fp4_gemm_problem() is None


@needs_fp4
@pytest.mark.parametrize("tokens, inp, out", [(128, 256, 128), (77, 512, 384), (3, 1024, 2048), (300, 7168, 1024)])
@pytest.mark.parametrize("static_input_scale", [False, True])
def test_fp4_path_matches_the_emulated_nvfp4_product(tokens, inp, out, static_input_scale):
    base = make_linear(out, inp)
    # bf16 activations, as the GPU sees them, so that both sides quantize the very same values
    x = (torch.randn(tokens, inp, generator=torch.Generator().manual_seed(4)) * 2).bfloat16().float()
    input_scale = global_scale_for(x) * 1.5 if static_input_scale else None
    linear = NVFP4Linear(base.nvfp4, base.bias, None, input_scale).to(CUDA)
    assert linear.path == PATH_CUDA_FP4, linear.path_reason
    # What the fp4 GEMM computes: both operands quantized to NVFP4, products summed, scales applied.
    act = quantize(x, input_scale if input_scale is not None else global_scale_for(x))
    want = F.linear(dequantize(act), dequantize(base.nvfp4), base.bias)
    got = linear(x.to(CUDA, torch.bfloat16))
    assert got.dtype == torch.bfloat16 and got.shape == (tokens, out)
    assert relative_error(got.cpu(), want) < 1e-2  # bf16 output rounding; a misplaced scale gives >> 0.1
    dense = F.linear(x, dequantize(base.nvfp4), base.bias)
    assert relative_error(got.cpu(), dense) < 0.2  # activations lose ~0.1 to 4 bits, as expected


@needs_fp4
def test_fp4_path_builds_swizzled_scales_once():
    linear = make_linear(256, 512).to(CUDA)
    linear.prepare()
    first = linear.swizzled_weight_scale
    assert first is not None and "swizzled_weight_scale" not in linear.state_dict()
    linear(torch.randn(5, 512, device=CUDA, dtype=torch.bfloat16))
    assert linear.swizzled_weight_scale is first


@needs_fp4
@pytest.mark.parametrize("out, inp", [(256, 13 * 16), (40, 7 * 16)])  # K not a multiple of 32, N not of 16
def test_odd_shapes_take_the_fp4_path_padded(out, inp):
    """Every shard of every rank takes the same path: odd block counts are padded with zero blocks."""
    base = make_linear(out, inp)
    x = (torch.randn(33, inp, generator=torch.Generator().manual_seed(6))).bfloat16().float()
    linear = NVFP4Linear(base.nvfp4, base.bias, None, global_scale_for(x)).to(CUDA)
    linear.prepare()
    assert linear.path == PATH_CUDA_FP4 and linear.fp4_weight is not None
    act = quantize(x, global_scale_for(x))
    want = F.linear(dequantize(act), dequantize(base.nvfp4), base.bias)
    assert relative_error(linear(x.to(CUDA, torch.bfloat16)).cpu(), want) < 1e-2


@needs_fp4
def test_cuda_fp4_matches_h3s_cpu_emulation():
    """The `cpu-fp4-emulated` path the dist tier proves parity with is what the GPU computes."""
    base = make_linear(384, 7 * 64)
    x = torch.randn(65, 7 * 64, generator=torch.Generator().manual_seed(8)).bfloat16().float()
    scale = global_scale_for(x) * 1.25
    cpu = NVFP4Linear(base.nvfp4, base.bias, None, scale)
    cpu.emulate_fp4 = True
    gpu = NVFP4Linear(base.nvfp4, base.bias, None, scale).to(CUDA)
    gpu.prepare()
    assert relative_error(gpu(x.to(CUDA, torch.bfloat16)).cpu(), cpu(x)) < 1e-2  # the GPU rounds its output to bf16


@needs_fp4
def test_fp4_operands_prepared_under_inference_mode():
    """bench_nvfp4_linear builds its weights under inference_mode: inference tensors have no version
    counter, and nothing on the fp4 path reads one."""
    with torch.inference_mode():
        linear = make_linear(256, 512).to(CUDA)
        linear.prepare()
        y = linear(torch.randn(5, 512, device=CUDA, dtype=torch.bfloat16))
    assert y.shape == (5, 256) and linear.prepared
