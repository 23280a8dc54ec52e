"""Hopper's option: an NVFP4 linear holding its weight decoded once gives bitwise the outputs of
decoding it on every forward, costs exactly `decoded_bytes`, and is dropped when the weight changes."""

from __future__ import annotations

import pytest
import torch

from h3core.nvfp4 import matmul
from h3core.nvfp4.linear import NVFP4Linear


def _linear(out_features: int, in_features: int, bias: bool, seed: int = 0) -> NVFP4Linear:
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=g) / in_features**0.5
    return NVFP4Linear.from_float(weight, torch.randn(out_features, generator=g) if bias else None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_elements", [None, 128 * 96])  # one chunk; several (tail joined to the last)
def test_held_decoded_weight_is_bitwise_the_decoding_forward(dtype, chunk_elements, monkeypatch):
    if chunk_elements is not None:
        monkeypatch.setitem(matmul.DEQUANT_CHUNK_ELEMENTS, "cpu", chunk_elements)
    lin = _linear(400, 96, bias=True)
    x = torch.randn(37, 96, generator=torch.Generator().manual_seed(1)).to(dtype)
    decoding, rows = lin(x), lin.forward_rows(x, slice(128, 300))
    out = torch.zeros(37, 3, 100, dtype=dtype)[:, 1, :]  # a strided destination, as Ulysses' send blocks
    lin.forward_rows(x, slice(0, 100), out=out)
    assert lin.hold_decoded(dtype) == NVFP4Linear.decoded_bytes(400, 96, dtype) == 400 * 96 * dtype.itemsize
    assert lin.decoded_weight.dtype == dtype
    held_out = torch.zeros_like(out)
    lin.forward_rows(x, slice(0, 100), out=held_out)
    assert torch.equal(lin(x), decoding)
    assert torch.equal(lin.forward_rows(x, slice(128, 300)), rows)
    assert torch.equal(held_out, out)


def test_the_held_weight_is_used_and_counted():
    lin = _linear(256, 64, bias=False)
    before = lin.resident_bytes
    lin.hold_decoded(torch.float32)
    assert lin.resident_bytes == before + 256 * 64 * 4
    assert "decoded_weight" not in lin.state_dict()  # files and shards see the packed format only
    lin.decoded_weight.zero_()  # a mutation: if forward still decoded, the output would not change
    assert torch.equal(lin(torch.randn(5, 64)), torch.zeros(5, 256))


def test_a_held_weight_of_another_dtype_is_not_used_and_a_new_weight_drops_it():
    lin = _linear(256, 64, bias=False)
    x = torch.randn(5, 64)
    expected = lin(x)
    lin.hold_decoded(torch.bfloat16)
    assert torch.equal(lin(x), expected)  # fp32 GEMM: the bf16 copy is not its operand
    lin.prepare()
    assert lin.decoded_weight is None
    lin.hold_decoded(torch.float32)
    lin.load_state_dict(_linear(256, 64, bias=False, seed=5).state_dict())
    assert lin.decoded_weight is None and not torch.equal(lin(x), expected)


def test_fp4_paths_hold_nothing_decoded():
    lin = _linear(256, 64, bias=False)
    lin.emulate_fp4 = True
    lin.prepare()
    assert lin.hold_decoded() == 0 and lin.decoded_weight is None
