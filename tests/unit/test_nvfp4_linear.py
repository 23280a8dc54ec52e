"""NVFP4Linear on the CPU: forward against the dense reference, buffers, skeletons, and the path choice."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from h3core.errors import NVFP4FormatError
from h3core.nvfp4 import layout
from h3core.nvfp4.codec import dequantize
from h3core.nvfp4.linear import NVFP4Linear
from h3core.nvfp4.matmul import (
    PATH_CPU_DEQUANT,
    PATH_CUDA_BF16,
    PATH_CUDA_FP4,
    choose_path,
    dequant_linear,
)

MODELOPT_KEYS = {"weight", "weight_scale", "weight_scale_2"}


def make_linear(out=48, inp=64, bias=True, seed=0) -> NVFP4Linear:
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(out, inp, generator=gen)
    return NVFP4Linear.from_float(weight, torch.randn(out, generator=gen) if bias else None)


def test_forward_is_f_linear_on_the_decoded_weight():
    linear = make_linear()
    x = torch.randn(3, 5, 64)
    expected = F.linear(x, dequantize(linear.nvfp4), linear.bias)
    assert linear.path == PATH_CPU_DEQUANT
    assert torch.equal(linear(x), expected)


def test_chunked_dequant_matches_one_shot():
    linear = make_linear(out=100, inp=64)
    x = torch.randn(9, 64)
    whole = dequant_linear(x, linear.nvfp4, linear.bias)
    chunked = dequant_linear(x, linear.nvfp4, linear.bias, chunk_elements=64 * 7)  # 7 rows a chunk, ragged tail
    torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=1e-5)  # summation order differs


def test_bf16_input_gives_bf16_output():
    linear = make_linear()
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    y = linear(x)
    assert y.dtype == torch.bfloat16
    # the bias is added after the GEMM (never fused), as tensor mode adds it after the reduction
    expected = F.linear(x, dequantize(linear.nvfp4, torch.bfloat16)) + linear.bias.to(torch.bfloat16)
    torch.testing.assert_close(y, expected)


def test_pre_quant_scale_multiplies_the_input_first():
    base = make_linear(bias=False)
    pre = torch.rand(64) + 0.5
    linear = NVFP4Linear(base.nvfp4, pre_quant_scale=pre)
    x = torch.randn(6, 64)
    assert torch.equal(linear(x), base(x * pre))


def test_buffers_are_modelopt_names_and_move_with_to():
    linear = NVFP4Linear(make_linear().nvfp4, torch.zeros(48), torch.ones(64), torch.tensor([0.5]))
    state = linear.state_dict()
    assert set(state) == MODELOPT_KEYS | {"bias", "pre_quant_scale", "input_scale"}
    assert state["weight"].dtype == torch.uint8 and state["weight_scale"].dtype == torch.float8_e4m3fn
    assert state["input_scale"].shape == () and state["input_scale"].dtype == torch.float32
    assert not list(linear.parameters())
    moved = linear.to("meta")
    assert all(buf.device.type == "meta" for buf in moved.buffers())
    assert set(make_linear(bias=False).state_dict()) == MODELOPT_KEYS


def test_dtype_casts_leave_the_format_alone():
    linear = NVFP4Linear(make_linear().nvfp4, torch.zeros(48), torch.ones(64), torch.tensor(0.0123456789))
    before = {k: v.clone() for k, v in linear.state_dict().items()}
    for cast in (lambda m: m.to(torch.bfloat16), lambda m: m.half(), lambda m: m.double(), lambda m: m.float()):
        cast(linear)
        assert linear.weight_scale.dtype == torch.float8_e4m3fn and linear.weight.dtype == torch.uint8
        assert linear.weight_scale_2.dtype == torch.float32 and linear.weight_scale_2.shape == ()
        assert torch.equal(linear.weight_scale_2, before["weight_scale_2"])  # not rounded through bf16
        assert torch.equal(linear.input_scale, before["input_scale"])
        assert torch.equal(linear.weight_scale.view(torch.uint8), before["weight_scale"].view(torch.uint8))
    linear.to(torch.bfloat16)
    assert linear.bias.dtype == torch.bfloat16 and linear.pre_quant_scale.dtype == torch.bfloat16
    assert linear(torch.randn(2, 64, dtype=torch.bfloat16)).dtype == torch.bfloat16
    assert linear.to("meta").weight_scale.device.type == "meta"


def test_state_dict_round_trips_into_a_skeleton():
    source = make_linear()
    skeleton = NVFP4Linear.skeleton(48, 64, bias=True, vector_dtype=torch.float32)
    skeleton.load_state_dict(source.state_dict(), assign=True)
    x = torch.randn(2, 64)
    assert torch.equal(skeleton(x), source(x))


def test_full_h3_block_is_counted_on_meta_without_memory():
    hidden, mlp = 7168, 10752
    shapes = [(3 * hidden, hidden), (hidden, hidden), (2 * mlp, hidden), (hidden, mlp)]  # qkv, out, fc1, fc2
    linears = [NVFP4Linear.skeleton(o, i, bias=True) for o, i in shapes]
    assert all(lin.weight.device.type == "meta" for lin in linears)
    expected = sum(layout.storage_bytes(o, i) + 2 * o for o, i in shapes)  # bf16 bias
    assert sum(lin.resident_bytes for lin in linears) == expected
    assert linears[0].path == PATH_CPU_DEQUANT  # meta is not CUDA


def test_resident_bytes_is_packed_plus_scales():
    linear = make_linear(bias=False)
    assert linear.resident_bytes == layout.storage_bytes(48, 64) == linear.nvfp4.nbytes


def test_nvfp4_property_is_the_buffers_themselves():
    linear = make_linear()
    assert linear.nvfp4.packed.data_ptr() == linear.weight.data_ptr()
    assert (linear.in_features, linear.out_features) == (64, 48)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(bias=torch.zeros(47)), "bias must be a float vector of 48"),
        (dict(bias=torch.zeros(48, dtype=torch.int64)), "bias must be a float vector"),
        (dict(pre_quant_scale=torch.ones(48)), "pre_quant_scale must be a float vector of 64"),
        (dict(input_scale=torch.ones(2)), "input_scale must be one float value"),
    ],
)
def test_bad_extras_are_rejected(kwargs, message):
    with pytest.raises(NVFP4FormatError, match=message):
        NVFP4Linear(make_linear(bias=False).nvfp4, **kwargs)


def test_wrong_input_width_is_an_error():
    with pytest.raises(ValueError, match="got input"):
        make_linear()(torch.randn(2, 32))


def test_skeleton_rejects_unaligned_width():
    with pytest.raises(NVFP4FormatError, match="multiple of 16"):
        NVFP4Linear.skeleton(8, 24)


# --- path selection ------------------------------------------------------------------------------


def kernel_ok() -> None:
    return None


def kernel_must_not_be_asked() -> None:
    raise AssertionError("the fp4 kernel probe ran although the path was already decided")


@pytest.mark.parametrize(
    "device, capability, inp, out, enabled, probe, path, reason",
    [
        ("cpu", None, 64, 48, True, kernel_must_not_be_asked, PATH_CPU_DEQUANT, "device type 'cpu'"),
        ("meta", None, 64, 48, True, kernel_must_not_be_asked, PATH_CPU_DEQUANT, "device type 'meta'"),
        ("cuda", (8, 0), 64, 48, True, kernel_must_not_be_asked, PATH_CUDA_BF16, "< (10, 0)"),
        ("cuda", (9, 0), 7168, 21504, True, kernel_must_not_be_asked, PATH_CUDA_BF16, "< (10, 0)"),
        ("cuda", (10, 0), 7168, 21504, True, kernel_ok, PATH_CUDA_FP4, "torch._scaled_mm"),
        ("cuda", (12, 0), 7168, 21504, True, kernel_ok, PATH_CUDA_FP4, "torch._scaled_mm"),
        ("cuda", (10, 0), 7168, 21504, False, kernel_must_not_be_asked, PATH_CUDA_BF16, "disabled"),
        ("cuda", (10, 0), 2160, 7168, True, kernel_must_not_be_asked, PATH_CUDA_BF16, "in % 32"),  # 135 blocks
        ("cuda", (10, 0), 7168, 24, True, kernel_must_not_be_asked, PATH_CUDA_BF16, "out % 16"),
        ("cuda", (10, 0), 7168, 7168, True, lambda: "RuntimeError: no cuBLASLt", PATH_CUDA_BF16, "no cuBLASLt"),
    ],
)
def test_choose_path(device, capability, inp, out, enabled, probe, path, reason):
    choice = choose_path(device, capability, inp, out, fp4_enabled=enabled, fp4_kernel_problem=probe)
    assert choice.path == path
    assert reason in choice.reason


def test_module_path_follows_its_flag_and_device():
    linear = make_linear()
    assert linear.path == PATH_CPU_DEQUANT and "cpu" in linear.path_reason
    linear.fp4_matmul = False
    assert linear.path == PATH_CPU_DEQUANT
    assert NVFP4Linear.fp4_matmul is True  # the instance flag does not leak to the class
