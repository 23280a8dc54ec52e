"""Tensor mode's "quantize before you gather", as a standalone mechanism: each rank quantizes its
own rows with the agreed activation global scale, the ranks gather codes + row-major scales, and
the result is bitwise what gathering bf16 rows and quantizing them gives, down to the layer's
output; without the agreement it is not."""

from __future__ import annotations

import pytest
import torch

from h3core.nvfp4.activation import eager_quantize_activation, gathered_gemm_operands, quantize_local_rows
from h3core.nvfp4.codec import global_scale_for
from h3core.nvfp4.linear import NVFP4Linear

RAGGED = [0, 5, 130, 1, 64]  # rows per rank: one holds none, one more than a 128-row tile


def split_rows(x: torch.Tensor, counts: list[int]) -> list[torch.Tensor]:
    return list(torch.split(x, counts))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gathered_codes_and_scales_are_the_quantized_gathered_rows(dtype):
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(sum(RAGGED), 208, generator=gen) * torch.logspace(-2, 2, 208)).to(dtype)
    agreed = global_scale_for(x)  # the all-reduced (MAX) amax of the whole gathered input
    parts = [quantize_local_rows(rows, agreed, 224) for rows in split_rows(x, RAGGED)]
    packed, scales = gathered_gemm_operands(parts)
    want_packed, want_scales = eager_quantize_activation(x, agreed, 224)
    assert torch.equal(packed, want_packed)
    assert torch.equal(scales.view(torch.uint8), want_scales.view(torch.uint8))


def test_without_the_agreed_scale_the_bits_differ():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(40, 64, generator=gen) * torch.linspace(0.1, 10, 40).unsqueeze(1)  # ranks with different amaxes
    parts = [quantize_local_rows(rows, global_scale_for(rows), 64) for rows in split_rows(x, [20, 20])]
    packed, _ = gathered_gemm_operands(parts)
    assert not torch.equal(packed, eager_quantize_activation(x, global_scale_for(x), 64)[0])


@pytest.mark.parametrize("static_input_scale", [False, True])
@pytest.mark.parametrize("pre_quant_scale", [False, True])
def test_the_linear_from_gathered_codes_is_bitwise_its_forward_on_gathered_rows(static_input_scale, pre_quant_scale):
    gen = torch.Generator().manual_seed(2)
    out, inp = 96, 13 * 16  # K padded to 224 and N to a multiple of 16 inside
    base = NVFP4Linear.from_float(torch.randn(out, inp, generator=gen), torch.randn(out, generator=gen))
    x = torch.randn(sum(RAGGED), inp, generator=gen)
    input_scale = global_scale_for(x) * 1.5 if static_input_scale else None
    pre = torch.rand(inp, generator=gen) + 0.5 if pre_quant_scale else None
    linear = NVFP4Linear(base.nvfp4, base.bias, pre, input_scale)
    linear.emulate_fp4 = True
    want = linear(x)  # one rank: the gathered rows, their own amax

    whole_amax = (x * (pre if pre is not None else 1)).abs().amax()
    linear.agree_amax = lambda amax: torch.maximum(amax, whole_amax)  # what the group's all-reduce MAX returns
    parts = [linear.quantize_input(rows) for rows in split_rows(x, RAGGED)]  # every rank, rows or none
    got = linear.forward_gathered(parts, x.dtype)
    assert torch.equal(got, want)


def test_codes_and_scales_move_nine_thirty_seconds_of_the_bf16_bytes():
    rows, width = 1857, 5376  # H3's hidden state, one rank's share of 14,855 rows at 8 ranks
    part = quantize_local_rows(torch.randn(rows, width).bfloat16(), torch.tensor(0.01), width)
    moved = part.packed.numel() + part.scale.numel()  # uint8 codes + fp8 scales
    assert moved * 32 == rows * width * 2 * 9  # 9/32 of the bf16 rows' bytes
