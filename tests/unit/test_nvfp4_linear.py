"""NVFP4Linear on the CPU: forward against the dense reference, buffers, skeletons, and the path choice."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import h3_reference as ref
from h3core.errors import ConfigError, NVFP4FormatError
from h3core.nvfp4 import layout
from h3core.nvfp4.codec import dequantize
from h3core.nvfp4.linear import NVFP4Linear
from h3core.nvfp4.matmul import (
    PATH_CPU_DEQUANT,
    PATH_CPU_FP4_EMULATED,
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


@pytest.mark.parametrize(
    "out, inp, tokens, dtype",
    [
        (1031, 448, 37, torch.float32),  # tails of 7 (128-row chunks) and 7 (256) rows join their neighbours
        (777, 1184, 5, torch.float32),  # tail of 9 rows: alone it took MKL's narrow-GEMM kernel
        (300, 64, 1, torch.float32),
        (2048, 16, 3, torch.float32),
        (777, 1184, 3, torch.bfloat16),
    ],
)
def test_every_chunking_gives_the_whole_product_to_its_summation_order(out, inp, tokens, dtype):
    """Chunks start on multiples of 128 rows and a tail under 128 rows joins the chunk before it, so
    no chunk GEMM is narrow. Whether a chunk's GEMM sums in the same order as one whole GEMM is the
    BLAS's choice and follows the CPU: bitwise on the AVX2 Xeon this was first derived on, not on an
    AVX-512 one (6.0e-5 at K = 1184 with |y| ~ 70, 1.2e-6 for a one-token GEMV), where MKL picks
    kernels by the output's width. What h3 promises is the product to its summation order: every
    chunking is within the reordering bound of the whole GEMM, and a chunk built from the wrong rows
    is far outside it."""
    w = make_linear(out=out, inp=inp, bias=False, seed=out).nvfp4
    x = torch.randn(tokens, inp, generator=torch.Generator().manual_seed(tokens)).to(dtype)
    whole = dequant_linear(x, w, None, chunk_elements=out * inp)
    decoded = dequantize(w, dtype)
    bound = ref.reorder_bound(x, decoded, whole)
    for rows in (1, 128, 256, 384, 512):
        chunked = dequant_linear(x, w, None, chunk_elements=rows * inp)
        gap = (chunked.float() - whole.float()).abs()
        assert bool((gap <= bound).all()), (rows, (gap - bound).max())
    # a mutation: the second chunk's columns computed from rows shifted by one
    shifted = whole.clone()
    shifted[:, 128:] = F.linear(x, torch.roll(decoded, 1, 0))[:, 128:]
    assert not bool(((shifted.float() - whole.float()).abs() <= bound).all())


def test_dequant_chunks_start_on_multiples_of_128_rows():
    from h3core.nvfp4.matmul import dequant_row_chunks

    assert dequant_row_chunks(2340 * 3, 7168, 1 << 24) == [slice(0, 2304), slice(2304, 4608), slice(4608, 7020)]
    for out, budget_rows in [(777, 128), (1031, 256), (21504, 2340), (100, 7), (129, 128)]:
        chunks = dequant_row_chunks(out, 64, budget_rows * 64)
        assert chunks[0].start == 0 and chunks[-1].stop == out
        assert all(a.stop == b.start for a, b in zip(chunks, chunks[1:]))
        assert all(c.start % 128 == 0 and c.stop - c.start >= min(out, 128) for c in chunks), chunks


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
    "device, capability, enabled, emulate, probe, path, reason",
    [
        ("cpu", None, True, False, kernel_must_not_be_asked, PATH_CPU_DEQUANT, "device type 'cpu'"),
        ("cpu", None, True, True, kernel_must_not_be_asked, PATH_CPU_FP4_EMULATED, "emulated GEMM"),
        ("meta", None, True, False, kernel_must_not_be_asked, PATH_CPU_DEQUANT, "device type 'meta'"),
        ("cuda", (8, 0), True, False, kernel_must_not_be_asked, PATH_CUDA_BF16, "< (10, 0)"),
        ("cuda", (9, 0), True, True, kernel_must_not_be_asked, PATH_CUDA_BF16, "< (10, 0)"),  # emulation is for CPUs
        ("cuda", (10, 0), True, False, kernel_ok, PATH_CUDA_FP4, "torch._scaled_mm"),
        ("cuda", (12, 0), True, False, kernel_ok, PATH_CUDA_FP4, "torch._scaled_mm"),
        ("cuda", (10, 0), False, False, kernel_must_not_be_asked, PATH_CUDA_BF16, "disabled"),
        ("cuda", (10, 0), True, False, lambda: "RuntimeError: no cuBLASLt", PATH_CUDA_BF16, "no cuBLASLt"),
    ],
)
def test_choose_path(device, capability, enabled, emulate, probe, path, reason):
    # Shape plays no part: every shape takes the fp4 GEMM (padded), so all ranks take one path.
    choice = choose_path(device, capability, fp4_enabled=enabled, emulate_fp4=emulate, fp4_kernel_problem=probe)
    assert choice.path == path
    assert reason in choice.reason


def test_emulation_follows_the_class_flag_then_the_environment(monkeypatch):
    linear = make_linear()
    monkeypatch.delenv("H3_EMULATE_FP4", raising=False)
    assert linear.path == PATH_CPU_DEQUANT
    monkeypatch.setenv("H3_EMULATE_FP4", "1")
    assert linear.path == PATH_CPU_FP4_EMULATED
    linear.emulate_fp4 = False  # an explicit flag beats the variable
    assert linear.path == PATH_CPU_DEQUANT
    monkeypatch.setenv("H3_EMULATE_FP4", "maybe")
    with pytest.raises(ConfigError, match="H3_EMULATE_FP4='maybe' is not a boolean"):
        make_linear().path
    from h3core.generate.request import GenerateRequest, resolve

    with pytest.raises(ConfigError, match="H3_EMULATE_FP4"):  # refused before any rank starts
        resolve(GenerateRequest(preset="tiny", world_size=3))


def test_module_path_follows_its_flag_and_device():
    linear = make_linear()
    assert linear.path == PATH_CPU_DEQUANT and "cpu" in linear.path_reason
    linear.fp4_matmul = False
    assert linear.path == PATH_CPU_DEQUANT
    assert NVFP4Linear.fp4_matmul is True  # the instance flag does not leak to the class


# --- the fp4 paths' activation global scale -------------------------------------------------------


def emulated(out=48, inp=64, seed=0, input_scale=None) -> NVFP4Linear:
    base = make_linear(out=out, inp=inp, bias=False, seed=seed)
    linear = NVFP4Linear(base.nvfp4, None, None, input_scale)
    linear.emulate_fp4 = True
    return linear


def test_activation_scale_is_the_checkpoints_else_the_agreed_amax():
    from h3core.nvfp4.codec import global_scale_for

    linear = emulated()
    x = torch.randn(5, 64)
    assert torch.equal(linear.activation_global_scale(x), global_scale_for(x))  # alone: this input's amax
    seen = []
    linear.agree_amax = lambda amax: seen.append(float(amax)) or torch.tensor(10.0)
    assert float(linear.activation_global_scale(x)) == pytest.approx(10 / 2688)  # the agreed amax
    assert seen == [float(x.abs().amax())]
    seen.clear()
    linear.input_scale = torch.tensor(0.25)
    assert float(linear.activation_global_scale(x)) == 0.25 and seen == []  # static: nothing to agree on


def test_a_rank_without_rows_joins_the_agreement_only_where_forward_would():
    seen = []
    linear = emulated()
    linear.agree_amax = lambda amax: seen.append(float(amax)) or amax
    linear.join_amax_agreement()
    assert seen == [0.0]
    linear(torch.randn(0, 64))  # zero rows: still agrees, then returns nothing
    assert seen == [0.0, 0.0]
    linear.emulate_fp4 = False  # cpu-dequant: quantizes nothing, agrees on nothing
    linear.join_amax_agreement()
    linear.emulate_fp4, linear.input_scale = True, torch.tensor(0.1)
    linear.join_amax_agreement()
    assert seen == [0.0, 0.0]


@pytest.mark.parametrize("parts", [2, 5])
def test_split_rows_with_the_agreed_scale_give_the_one_rank_rows(parts):
    """Ulysses in one process: each part's rows quantized with the whole input's amax give the
    whole product's rows; with their own amax (the bug) they are off by the quantization error."""
    linear = emulated(out=96, inp=128, seed=1)
    x = torch.randn(23, 128) * torch.logspace(-1, 1, 23).unsqueeze(1)  # rows of different sizes
    whole = linear(x)
    pieces = x.tensor_split(parts)
    linear.agree_amax = lambda amax: x.abs().amax()  # what the all-reduce MAX over the parts returns
    agreed = torch.cat([linear(p) for p in pieces])
    linear.agree_amax = None
    alone = torch.cat([linear(p) for p in pieces])
    scale = whole.abs().max()
    assert ((agreed - whole).abs().max() / scale).item() < 1e-6  # GEMM rounding of fewer rows only
    assert ((alone - whole).abs().max() / scale).item() > 1e-3


def test_split_columns_with_the_agreed_scale_sum_to_the_one_rank_product():
    """Tensor mode's row-parallel shards (ragged: 5 ranks over 13 blocks, odd counts padded)."""
    from h3core.nvfp4.shard import row_parallel
    from h3core.parallel.partition import nvfp4_column_slices

    full = emulated(out=64, inp=13 * 16, seed=2)
    x = torch.randn(9, full.in_features)
    whole = full(x)
    for agree in (True, False):
        total = torch.zeros_like(whole)
        for cols in nvfp4_column_slices(full.in_features, 5):
            shard, _ = row_parallel(full, cols)
            shard.emulate_fp4 = True
            if agree:
                shard.agree_amax = lambda amax: x.abs().amax()
            total += shard(x[:, cols.elements.start : cols.elements.stop])
        relative = ((total - whole).abs().max() / whole.abs().max()).item()
        assert relative < 1e-6 if agree else relative > 1e-3, (agree, relative)


@pytest.mark.parametrize(
    "out, inp, tokens, rows",
    [
        (3 * 56 * 16, 896, 37, slice(2 * 896 + 5 * 16, 2 * 896 + 12 * 16)),  # 7 heads of v, narrow preset widths
        (3 * 8 * 16, 128, 1, slice(2 * 128 + 16, 2 * 128 + 32)),  # one 16-wide head, one token
        (3 * 7 * 128, 896, 3, slice(2 * 896, 3 * 896)),  # v whole
        (1031, 448, 5, slice(0, 1031)),  # every row, chunked with a tail
    ],
)
def test_forward_rows_into_a_strided_view_is_bitwise_those_columns_of_forward(out, inp, tokens, rows):
    """What lets Ulysses' v GEMM write straight into the all-to-all's send blocks: only `rows` are
    decoded, the GEMM writes through the view's row stride, and the bits are forward's."""
    linear = make_linear(out=out, inp=inp, seed=out)
    x = torch.randn(tokens, inp, generator=torch.Generator().manual_seed(tokens))
    width = rows.stop - rows.start
    assert linear.rows_apart
    assert torch.equal(linear.forward_rows(x, rows), linear(x)[:, rows])
    buffer = torch.full((tokens, 3, width), float("nan"))  # v's place in a [S, 3, w] block
    result = linear.forward_rows(x, rows, out=buffer[:, 2])
    assert result.data_ptr() == buffer[:, 2].data_ptr()
    assert torch.equal(buffer[:, 2], linear(x)[:, rows]) and buffer[:, :2].isnan().all()


def test_forward_rows_on_the_fp4_path_copies_the_whole_forwards_columns():
    """The fp4 paths quantize the whole input with one scale: rows are not computed apart there."""
    linear = emulated(out=96, inp=128, seed=3)
    x = torch.randn(4, 128)
    out = torch.full((4, 2, 32), float("nan"))[:, 1]
    assert not linear.rows_apart
    linear.forward_rows(x, slice(64, 96), out=out)
    assert torch.equal(out, linear(x)[:, 64:96])


def test_forward_rows_runs_through_the_module_so_hooks_see_it():
    """Calibration (input amax) and `--profile` (time per linear) hook the module: a rows-only GEMM
    must pass through them like a whole forward."""
    linear = make_linear(out=96, inp=64)
    seen = []
    linear.register_forward_pre_hook(lambda module, args: seen.append(args[0].shape))
    linear.forward_rows(torch.randn(5, 64), slice(32, 64))
    assert seen == [torch.Size([5, 64])]
