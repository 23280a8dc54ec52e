"""The fp4 GEMM path on the CPU: the `_scaled_mm` call contract (torch's meta kernel) and the whole
path end to end against an emulated cuBLAS NVFP4 GEMM that reads operands the way the docs say."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from h3core.nvfp4 import linear as linear_module
from h3core.nvfp4 import matmul
from h3core.nvfp4.codec import NVFP4Weight, dequantize, global_scale_for, quantize
from h3core.nvfp4.linear import NVFP4Linear
from h3core.nvfp4.matmul import (
    PATH_CPU_FP4_EMULATED,
    PATH_CUDA_FP4,
    PathChoice,
    emulated_scaled_mm_fp4,
    fp4_linear,
    prepare_fp4_weight,
    scaled_mm_fp4,
)
from h3core.nvfp4.swizzle import swizzle_block_scales, unswizzle_block_scales


@pytest.mark.parametrize("m, k, n", [(128, 64, 128), (45, 96, 1024), (2, 1024, 144), (197, 224, 272)])
def test_fp4_operands_satisfy_scaled_mm_contract(m, k, n):
    # torch's meta kernel for _scaled_mm runs the CUDA-side checks (row/column-major operands, K and N
    # multiples of 16 packed, swizzled scale sizes and contiguity), so the call is checked on the CPU.
    weight = quantize(torch.randn(n, k)).to("meta")
    act = quantize(torch.randn(m, k)).to("meta")
    out = scaled_mm_fp4(act.packed, swizzle_block_scales(act.scale), weight.packed, swizzle_block_scales(weight.scale))
    assert out.shape == (m, n) and out.dtype == torch.bfloat16


def test_unswizzled_scales_break_the_contract():
    weight = quantize(torch.randn(256, 64)).to("meta")
    with pytest.raises(RuntimeError, match="scale_a should have"):
        unswizzled = weight.scale[:100].reshape(-1)
        scaled_mm_fp4(weight.packed[:100], unswizzled, weight.packed, swizzle_block_scales(weight.scale))


@pytest.mark.parametrize("out, inp", [(96, 64), (40, 208), (7168, 16 * 13)])  # 13 blocks: K padded to 224
@pytest.mark.parametrize("two_level", [True, False], ids=["F.scaled_mm two-level", "fp32 output + epilogue"])
def test_full_fp4_linear_runs_on_meta(monkeypatch, out, inp, two_level):
    monkeypatch.setattr(matmul, "_has_two_level_nvfp4", lambda: two_level)
    # The padded operands (K to a multiple of 32, N of 16) satisfy the kernel contract too.
    weight = quantize(torch.randn(out, inp)).to("meta")
    packed, swizzled = prepare_fp4_weight(weight)
    gemm_weight = weight.packed if packed is None else packed
    assert (packed is None) == (out % 16 == 0 and inp % 32 == 0)
    x = torch.empty(7, inp, dtype=torch.bfloat16, device="meta")
    bias = torch.empty(out, dtype=torch.bfloat16, device="meta")
    y = fp4_linear(x, weight, gemm_weight, swizzled, bias, torch.tensor(0.01, device="meta"))
    assert y.shape == (7, out) and y.dtype == torch.bfloat16


def emulated_scaled_mm(a, b, scale_a, scale_b, out_dtype):
    """cuBLAS's NVFP4 GEMM as documented: A [M, K/2] row-major, B [K/2, N] column-major fp4; block
    scales in the 128x4 swizzled layout; D = sum_k (a * sa) (b * sb), accumulated in fp32."""
    assert a.dtype == b.dtype == torch.float4_e2m1fn_x2 and out_dtype in (torch.bfloat16, torch.float32)
    assert a.is_contiguous() and b.t().is_contiguous()
    m, n, k = a.shape[0], b.shape[1], a.shape[1] * 2
    a_packed, b_packed = a.view(torch.uint8), b.t().view(torch.uint8)  # [M, K/2], [N, K/2]
    sa, sb = unswizzle_block_scales(scale_a, m, k // 16), unswizzle_block_scales(scale_b, n, k // 16)
    one = torch.tensor(1.0)
    return (dequantize(NVFP4Weight(a_packed, sa, one)) @ dequantize(NVFP4Weight(b_packed, sb, one)).T).to(out_dtype)


def emulated_two_level_scaled_mm(a, b, scale_a, recipe_a, scale_b, recipe_b, swizzle_a=None, swizzle_b=None, bias=None, output_dtype=torch.bfloat16):
    """torch's NVFP4 two-level recipe as documented (`F.scaled_mm`): [swizzled fp8 block scales,
    fp32 tensor scale] per operand; alpha = the tensor scales' product on the fp32 accumulator, the
    bias added there, one rounding."""
    block, tensor = F.ScalingType.BlockWise1x16, F.ScalingType.TensorWise
    assert list(recipe_a) == list(recipe_b) == [block, tensor]
    assert list(swizzle_a) == list(swizzle_b) == [F.SwizzleType.SWIZZLE_32_4_4, F.SwizzleType.NO_SWIZZLE]
    assert scale_a[1].dtype == scale_b[1].dtype == torch.float32 and scale_a[1].numel() == scale_b[1].numel() == 1
    acc = emulated_scaled_mm(a, b, scale_a[0], scale_b[0], torch.float32) * (scale_a[1] * scale_b[1])
    if bias is not None:
        assert bias.dtype == output_dtype
        acc = acc + bias.float()
    return acc.to(output_dtype)


@pytest.mark.parametrize("out, inp", [(160, 192), (40, 208), (24, 16)])  # 208, 16: odd block counts; 40, 24: N % 16 != 0
@pytest.mark.parametrize("static_input_scale", [False, True])
@pytest.mark.parametrize("two_level", [True, False], ids=["F.scaled_mm two-level", "fp32 output + epilogue"])
def test_fp4_path_end_to_end_against_the_emulated_gemm(monkeypatch, out, inp, static_input_scale, two_level):
    monkeypatch.setattr(torch, "_scaled_mm", emulated_scaled_mm)
    monkeypatch.setattr(F, "scaled_mm", emulated_two_level_scaled_mm)
    monkeypatch.setattr(matmul, "_has_two_level_nvfp4", lambda: two_level)
    monkeypatch.setattr(linear_module, "choose_path", lambda *a, **k: PathChoice(PATH_CUDA_FP4, "forced for the test"))
    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(out, inp, generator=gen) * torch.logspace(-2, 1, out).unsqueeze(1)  # varied block scales
    base = NVFP4Linear.from_float(weight, torch.randn(out, generator=gen))
    x = torch.randn(2, 67, inp, generator=gen)
    input_scale = global_scale_for(x) * 2 if static_input_scale else None
    linear = NVFP4Linear(base.nvfp4, base.bias, None, input_scale)
    assert linear.path == PATH_CUDA_FP4
    got = linear(x)
    act = quantize(x.reshape(-1, inp), input_scale if input_scale is not None else global_scale_for(x))
    want = F.linear(dequantize(act), dequantize(base.nvfp4), base.bias).reshape(2, 67, out)
    assert got.dtype == torch.float32 and got.shape == (2, 67, out)
    rel = ((got - want).norm() / want.norm()).item()
    assert rel < 1e-2, rel  # bf16 GEMM output; a transposed or misplaced scale gives errors near 1
    assert linear.swizzled_weight_scale is not None and "swizzled_weight_scale" not in linear.state_dict()
    padded = out % 16 or inp % 32
    assert (linear.fp4_weight is not None) == bool(padded) and "fp4_weight" not in linear.state_dict()


@pytest.mark.parametrize("out, inp", [(160, 192), (40, 208), (24, 16), (256, 13 * 16)])
def test_h3_emulation_reads_what_the_documented_gemm_reads(out, inp):
    """h3's `emulated_scaled_mm_fp4` (the `cpu-fp4-emulated` path's GEMM) against this file's
    independent reading of cuBLAS's documented layout, on the padded operands the path builds."""
    gen = torch.Generator().manual_seed(out + inp)
    weight = quantize(torch.randn(out, inp, generator=gen) * torch.logspace(-2, 1, out).unsqueeze(1))
    packed, swizzled = prepare_fp4_weight(weight)
    packed = weight.packed if packed is None else packed
    rows, width = packed.shape[0], packed.shape[1] * 2
    act = quantize(torch.randn(33, width, generator=gen))
    a_scale = swizzle_block_scales(act.scale)
    ours = emulated_scaled_mm_fp4(act.packed, a_scale, packed, swizzled, torch.float32)
    documented = emulated_scaled_mm(
        act.packed.view(torch.float4_e2m1fn_x2), packed.view(torch.float4_e2m1fn_x2).t(), a_scale, swizzled, torch.bfloat16
    )
    assert ours.shape == (33, rows)
    assert torch.equal(ours.bfloat16(), documented)


@pytest.mark.parametrize("out, inp", [(160, 192), (40, 208), (256, 13 * 16)])
def test_emulated_path_is_the_quantized_product(out, inp):
    """`cpu-fp4-emulated`: activations quantized with the activation global scale, decoded, times
    the decoded weight; padding changes nothing (zero blocks), so it equals the unpadded product."""
    gen = torch.Generator().manual_seed(7)
    base = NVFP4Linear.from_float(torch.randn(out, inp, generator=gen), torch.randn(out, generator=gen))
    linear = NVFP4Linear(base.nvfp4, base.bias, None, torch.tensor(0.003))
    linear.emulate_fp4 = True
    assert linear.path == PATH_CPU_FP4_EMULATED
    x = torch.randn(19, inp, generator=gen)
    want = F.linear(dequantize(quantize(x, torch.tensor(0.003))), dequantize(base.nvfp4)) + base.bias
    got = linear(x)
    # Global scales multiply after the GEMM here, before it in `want`: fp32 rounding only.
    assert ((got - want).abs().max() / want.abs().max()).item() < 2e-6
    assert linear.prepared and (linear.fp4_weight is not None) == bool(out % 16 or inp % 32)


def test_alpha_is_applied_in_fp32_before_the_one_rounding_to_bf16():
    """The fp4 GEMM's result in bf16 is within one bf16 rounding of the exact product times alpha
    (plus fp32 accumulation): alpha = act_global * weight_global meets the fp32 accumulator, not a
    rounded result. The old order (GEMM rounded to bf16, then multiplied by alpha and rounded
    again) fails the same bound."""
    gen = torch.Generator().manual_seed(11)
    out, inp, m = 64, 256, 96
    weight = quantize(torch.randn(out, inp, generator=gen))
    packed, swizzled = prepare_fp4_weight(weight)
    x = torch.randn(m, inp, generator=gen)
    act_global = torch.tensor(1.0 + 3 * 2.0**-9) * global_scale_for(x)  # any scale: alpha is not a power of two
    alpha = act_global * weight.global_scale  # fp32, as the GEMM computes it
    got = fp4_linear(x, weight, weight.packed, swizzled, None, act_global, out_dtype=torch.bfloat16, gemm=emulated_scaled_mm_fp4)
    assert got.dtype == torch.bfloat16

    act = quantize(x, act_global)
    one = torch.tensor(1.0)
    a = dequantize(NVFP4Weight(act.packed, act.scale, one)).double()  # exact decoded values, no global scale
    b = dequantize(NVFP4Weight(weight.packed, weight.scale, one)).double()
    ref, magnitude = (a @ b.T) * alpha.double(), (a.abs() @ b.abs().T) * alpha.double()
    bound = 2.0**-8 * ref.abs() + (inp + 1) * 2.0**-24 * (1 + 2.0**-8) * magnitude
    assert ((got.double() - ref).abs() <= bound).all()

    acc = emulated_scaled_mm_fp4(act.packed, swizzle_block_scales(act.scale), weight.packed, swizzled, torch.bfloat16)
    old = acc * alpha  # the old order: the GEMM's bf16 result times alpha (in fp32), rounded again
    assert ((old.double() - ref).abs() > bound).float().mean() > 0.03  # measured: 5.9% of the outputs
