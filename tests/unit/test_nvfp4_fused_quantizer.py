"""The fused Triton activation quantizer is bit for bit the eager codec (`quantize_unchecked` +
`swizzle_block_scales`), run on the CPU under Triton's interpreter (`TRITON_INTERPRET=1`): at H3's
widths, over exact ties (of the E2M1 codes and of the e4m3 block scales), saturation, underflow,
-0.0, padding (K not a multiple of 64, M not of 128), strided rows and bf16 / fp16 / fp32 input;
and it is one launch where the eager codec issues hundreds to thousands of kernels."""

from __future__ import annotations

import os
import sys
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from h3core.nvfp4 import activation
from h3core.nvfp4.activation import eager_quantize_activation, fused_quantize_activation, fused_quantize_rows
from h3core.nvfp4.codec import E2M1_VALUES, global_scale_for, quantize_unchecked

# Triton builds its own standard library (tl.max, ...) for the interpreter or for a GPU when it is
# first imported, so the mode is set before that; a session that imported triton for a GPU first
# cannot interpret (run tests/gpu in a session of its own).
_IMPORTED_FOR_A_GPU = "triton.language" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(_IMPORTED_FOR_A_GPU, reason="triton was imported for a GPU earlier in this session")


def assert_bit_identical(x: torch.Tensor, global_scale: torch.Tensor, width: int) -> None:
    want_packed, want_scales = eager_quantize_activation(x, global_scale, width)
    got_packed, got_scales = fused_quantize_activation(x, global_scale, width)
    assert got_packed.shape == want_packed.shape and got_scales.shape == want_scales.shape
    assert torch.equal(got_packed, want_packed), f"{int((got_packed != want_packed).sum())} packed bytes differ"
    differ = got_scales.view(torch.uint8) != want_scales.view(torch.uint8)
    assert not differ.any(), f"{int(differ.sum())} swizzled scale bytes differ"
    # the row-major form tensor mode quantizes its own rows into before it gathers them
    want = quantize_unchecked(x, global_scale, padded_width=width)
    got = fused_quantize_rows(x, global_scale, width)
    assert torch.equal(got.packed, want.packed), f"{int((got.packed != want.packed).sum())} packed bytes of the rows differ"
    differ = got.scale.view(torch.uint8) != want.scale.view(torch.uint8)
    assert not differ.any(), f"{int(differ.sum())} row-major scale bytes differ"
    assert torch.equal(got.global_scale, want.global_scale.float().reshape(()))


def e4m3_values() -> torch.Tensor:
    """Every finite positive float8-e4m3fn value, ascending (subnormals 2^-9 .. 7 * 2^-9, then 2^-6 .. 448)."""
    values = torch.arange(1, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    return values.sort().values


def with_specials(x: torch.Tensor) -> torch.Tensor:
    """Rows of `x` with an all-zero block, a -0.0 block, a block of tiny values (its scale
    underflows to zero: stored as 1.0), a negative-tiny block (codes -0) and a lone -0.0."""
    x = x.clone()
    x[0, :16] = 0.0
    x[-1, 5] = -0.0
    if x.shape[1] >= 32:
        x[0, 16:32] = -0.0
    if x.shape[0] >= 2:
        x[1, :16] = 1e-30
        x[1, 16:32] = -1e-30
    return x


@pytest.mark.parametrize("width", [5376, 7168, 14336])  # H3: hidden, heads x head_dim, mlp
def test_h3_widths_in_bf16(width):
    gen = torch.Generator().manual_seed(width)
    x = torch.randn(3, width, generator=gen) * torch.logspace(-3, 2, width)  # block scales over a wide range
    x = with_specials(x).bfloat16()
    assert_bit_identical(x, global_scale_for(x), width)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_input_dtypes(dtype):
    gen = torch.Generator().manual_seed(1)
    x = with_specials(torch.randn(5, 320, generator=gen) * 4).to(dtype)
    assert_bit_identical(x, global_scale_for(x), 320)


def tie_blocks(scale: float, global_scale: float) -> torch.Tensor:
    """One block whose max is 6 * scale * gs (so the block scale is `scale` exactly) and whose other
    elements divide by scale * gs to the E2M1 midpoints (ties), both signs, 0, -0 and saturation."""
    ratios = [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -5.0, -0.0, 0.0, 0.125, 4.5, -6.0]
    return torch.tensor(ratios) * (scale * global_scale)


def test_code_ties_round_to_even_as_the_codec():
    gs = 2.0**-10  # a power of two: every product below is exact in fp32 and bf16
    scales = [2.0**-9, 3 * 2.0**-9, 2.0**-6, 1.0, 1.125, 1.75, 13.0, 448.0]
    x = torch.stack([tie_blocks(s, gs) for s in scales])  # [8, 16]: one block per row
    codes = E2M1_VALUES  # the midpoints are exact ties of these values, so the test is sharp
    assert {0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0} <= {float((codes[i] + codes[i + 1]) / 2) for i in range(7)}
    for dtype in (torch.float32, torch.bfloat16):
        assert_bit_identical(x.to(dtype), torch.tensor(gs), 32)


def test_block_scale_ties_and_every_e4m3_value():
    """Block amaxes that put amax / (6 gs) on every e4m3 value and on every midpoint between two
    (ties to even), below the smallest subnormal (the scale underflows) and above 448 (saturates)."""
    values = e4m3_values()
    midpoints = (values[:-1] + values[1:]) / 2
    wanted = torch.cat([values, midpoints, torch.tensor([2.0**-11, 2.0**-10, 1.5 * 2.0**-10, 460.0, 464.0, 1000.0])])
    gs = 2.0**-10
    x = torch.zeros(len(wanted), 16)
    x[:, 0] = wanted * (6 * gs)  # exact: 6 * gs = 3 * 2^-9, wanted has at most 5 significant bits
    x[:, 1:] = torch.linspace(-1, 1, 15) * x[:, :1]
    rounded_up = (midpoints.to(torch.float8_e4m3fn).float() > midpoints).sum()
    assert 0 < rounded_up < len(midpoints)  # both tie directions occur: a truncating rounding would fail
    assert_bit_identical(x, torch.tensor(gs), 16)


def test_saturation_against_a_static_input_scale():
    """A checkpoint's static `input_scale` below the activation's amax: block scales saturate at 448
    and codes at 6, the same way in both."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(4, 256, generator=gen) * 10
    assert_bit_identical(x, global_scale_for(x) / 8, 256)


@pytest.mark.parametrize(
    "rows, cols, width",
    [(3, 208, 224), (130, 64, 64), (1, 16, 32), (129, 336, 352), (128, 96, 96), (257, 48, 64)],
    ids=["K 13 blocks -> 14", "M 130", "one row", "M 129, scale columns padded to 24", "whole tile", "M 257, K 3 blocks -> 4"],
)
def test_padding_of_rows_columns_and_scale_tiles(rows, cols, width):
    gen = torch.Generator().manual_seed(rows + cols)
    x = with_specials(torch.randn(rows, cols, generator=gen)).bfloat16()
    assert_bit_identical(x, global_scale_for(x), width)


def test_strided_rows_as_a_view_of_qkv():
    gen = torch.Generator().manual_seed(4)
    qkv = torch.randn(9, 3 * 128, generator=gen).bfloat16()
    q = qkv[:, :128]  # row stride 384
    assert q.stride() == (384, 1)
    assert_bit_identical(q, global_scale_for(q), 128)


# --- kernels: eager issues a kernel per op per row chunk; fused is one launch ----------------------

VIEW_OPS = {"view", "_unsafe_view", "slice", "select", "alias", "t", "transpose", "unsqueeze", "squeeze", "permute", "expand", "as_strided", "detach", "reshape"}


class CountOps(TorchDispatchMode):
    """Counts the aten ops that would launch a device kernel (views excluded)."""

    def __init__(self):
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in VIEW_OPS:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("rows, width, at_least", [(14855, 5376, 900), (14855, 7168, 1100), (14855, 14336, 2200), (1857, 14336, 300)])
def test_the_eager_codec_issues_hundreds_to_thousands_of_kernels(rows, width, at_least):
    """At H3's shapes (one GPU: 14,855 rows; eight: 1,857), on meta tensors (nothing computed)."""
    x = torch.empty(rows, width, dtype=torch.bfloat16, device="meta")
    with CountOps() as count:
        eager_quantize_activation(x, torch.empty((), device="meta"), width)
    assert sum(count.ops.values()) >= at_least, count.ops


def test_the_fused_quantizer_is_one_launch_and_allocations(monkeypatch):
    launches = []

    class Launcher:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append(grid)

    monkeypatch.setattr(activation, "_kernel", lambda: Launcher())
    fused_quantize_activation(torch.zeros(300, 256), torch.ones(()), 256)  # the launch op's real implementation
    assert launches == [(384 // 32, 16 // 16)]
    x = torch.empty(14855, 14336, dtype=torch.bfloat16, device="meta")  # no data: the launch op's fake
    with CountOps() as count:
        packed, scales = fused_quantize_activation(x, torch.empty((), device="meta"), 14336)
    assert set(count.ops) == {"empty", "fused_nvfp4_quantize"} and count.ops["fused_nvfp4_quantize"] == 1, count.ops
    assert packed.shape == (14855, 7168) and scales.numel() == 14976 * 896
