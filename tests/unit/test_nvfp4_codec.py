"""The NVFP4 codec against independent references: E2M1 rounding, packing, bit-exact decoding, quantization."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from h3core.errors import NVFP4FormatError
from h3core.nvfp4 import layout
from h3core.nvfp4.codec import (
    E2M1_VALUES,
    NVFP4Weight,
    decode_e2m1,
    dequantize,
    encode_e2m1,
    global_scale_for,
    pack_codes,
    quantize,
    unpack_codes,
)

MAGNITUDES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def reference_encode(value: float) -> int:
    """Nearest E2M1 magnitude by distance, ties to the even code (mantissa bit 0), sign from the sign bit."""
    magnitude = min(abs(value), 6.0)
    distances = [abs(magnitude - m) for m in MAGNITUDES]
    best = min(distances)
    candidates = [code for code, d in enumerate(distances) if d == best]
    code = next((c for c in candidates if c % 2 == 0), candidates[0])
    return code | (8 if np.signbit(value) else 0)


def e4m3_value(byte: int) -> float:
    """float8-e4m3fn decoded from its bits by hand (bias 7, subnormals at exponent 0)."""
    sign = -1.0 if byte & 0x80 else 1.0
    exponent, mantissa = (byte >> 3) & 0x0F, byte & 0x07
    if exponent == 0:
        return sign * mantissa / 8 * 2.0**-6
    return sign * (1 + mantissa / 8) * 2.0 ** (exponent - 7)


FINITE_E4M3_BYTES = [b for b in range(256) if b & 0x7F != 0x7F]
POSITIVE_E4M3 = [(e4m3_value(b), b) for b in range(0x7F)]  # 0 .. 448, ascending


def reference_e4m3(value: float) -> float:
    """Round a non-negative value onto e4m3 by search: nearest, ties to the even byte, saturating at 448."""
    best = min(abs(value - v) for v, _ in POSITIVE_E4M3)
    candidates = [(v, b) for v, b in POSITIVE_E4M3 if abs(value - v) == best]
    return next((v for v, b in candidates if b % 2 == 0), candidates[0][0])


def test_code_table_is_nvfp4_md():
    assert E2M1_VALUES.dtype == torch.float32
    assert E2M1_VALUES[:8].tolist() == MAGNITUDES
    assert (E2M1_VALUES[8:] == -E2M1_VALUES[:8]).all()
    assert torch.signbit(E2M1_VALUES[8])  # code 8 is -0


@pytest.mark.parametrize(
    "magnitude, code",
    [(0.25, 0), (0.2500001, 1), (0.7499999, 1), (0.75, 2), (1.25, 2), (1.2500001, 3), (1.7499999, 3), (1.75, 4),
     (2.5, 4), (2.5000002, 5), (3.4999998, 5), (3.5, 6), (5.0, 6), (5.0000005, 7), (1e30, 7), (float("inf"), 7)],
)
def test_boundaries_of_nvfp4_md(magnitude, code):
    assert encode_e2m1(torch.tensor([magnitude])).item() == code
    assert encode_e2m1(torch.tensor([-magnitude])).item() == code | 8


def test_encode_matches_nearest_even_reference_on_grid_and_random():
    midpoints = [(a + b) / 2 for a, b in zip(MAGNITUDES, MAGNITUDES[1:])]
    grid = MAGNITUDES + midpoints + [m * s for m in midpoints for s in (0.999, 1.001)] + [7.0, 100.0]
    values = torch.tensor(grid + [-v for v in grid], dtype=torch.float32)
    values = torch.cat([values, torch.randn(4000, generator=torch.Generator().manual_seed(0)) * 3])
    expected = [reference_encode(v) for v in values.tolist()]
    assert encode_e2m1(values).tolist() == expected


def test_decode_inverts_encode_on_every_code():
    codes = torch.arange(16, dtype=torch.uint8)
    values = decode_e2m1(codes)
    assert torch.equal(values.view(torch.int32), E2M1_VALUES.view(torch.int32))
    assert torch.equal(encode_e2m1(values), codes)


def test_packing_puts_element_2j_in_the_low_nibble():
    codes = torch.tensor([[1, 2, 3, 4, 15, 0]], dtype=torch.uint8)
    packed = pack_codes(codes)
    assert packed.tolist() == [[0x21, 0x43, 0x0F]]
    assert torch.equal(unpack_codes(packed), codes)


def test_pack_unpack_round_trip_random():
    codes = torch.randint(0, 16, (3, 5, 64), dtype=torch.uint8)
    assert torch.equal(unpack_codes(pack_codes(codes)), codes)


def reference_decode(packed: np.ndarray, scale_bytes: np.ndarray, global_scale: np.float32) -> np.ndarray:
    """NVFP4.md's formula in numpy float32, with scales decoded from their bits by hand."""
    low, high = packed & 0x0F, packed >> 4
    codes = np.stack([low, high], axis=-1).reshape(packed.shape[0], -1)
    values = np.array([float(v) for v in E2M1_VALUES.tolist()], dtype=np.float32)[codes]
    scale = np.vectorize(e4m3_value)(scale_bytes).astype(np.float32)
    block = (scale * global_scale).astype(np.float32)  # float(weight_scale) * weight_scale_2, in float32
    with np.errstate(over="ignore"):  # the 2.5e35 case overflows to inf, as float32 does
        return (values * np.repeat(block, 16, axis=1)).astype(np.float32)


@pytest.mark.parametrize("global_scale", [1.0, 0.0123456, 3.7e-3, 1e-39, 2.5e35])
def test_decode_is_bit_exact_for_every_code_and_every_finite_scale(global_scale):
    # One row per finite e4m3 value; every row holds all 16 codes (in = 16: one block).
    scale_bytes = np.array(FINITE_E4M3_BYTES, dtype=np.uint8).reshape(-1, 1)
    codes = np.tile(np.arange(16, dtype=np.uint8), (len(FINITE_E4M3_BYTES), 1))
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    gs = np.float32(global_scale)
    w = NVFP4Weight(
        torch.from_numpy(packed), torch.from_numpy(scale_bytes).view(torch.float8_e4m3fn), torch.tensor(gs)
    )
    got = dequantize(w).numpy()
    expected = reference_decode(packed, scale_bytes, gs)
    assert np.array_equal(got.view(np.int32), expected.view(np.int32))


def test_decode_is_bit_exact_for_random_codes_and_scales():
    rng = np.random.default_rng(1)
    packed = rng.integers(0, 256, size=(37, 48), dtype=np.uint8)  # in = 96: 6 blocks
    scale_bytes = rng.choice(np.array(FINITE_E4M3_BYTES, dtype=np.uint8), size=(37, 6))
    gs = np.float32(rng.uniform(1e-4, 1e-1))
    w = NVFP4Weight(torch.from_numpy(packed), torch.from_numpy(scale_bytes).view(torch.float8_e4m3fn), torch.tensor(gs))
    expected = reference_decode(packed, scale_bytes, gs)
    assert np.array_equal(dequantize(w).numpy().view(np.int32), expected.view(np.int32))
    assert torch.equal(dequantize(w, torch.bfloat16), torch.from_numpy(expected).to(torch.bfloat16))


def reference_quantize(weight: np.ndarray, gs: np.float32) -> tuple[np.ndarray, np.ndarray]:
    """ModelOpt's recipe written element by element: codes [out, in] and scale values [out, in/16]."""
    rows, cols = weight.shape
    codes = np.zeros((rows, cols), dtype=np.uint8)
    scales = np.zeros((rows, cols // 16), dtype=np.float32)
    for r in range(rows):
        for b in range(cols // 16):
            block = weight[r, b * 16 : (b + 1) * 16]
            wanted = np.float32(np.abs(block).max()) / np.float32(np.float32(6.0) * gs)
            s = reference_e4m3(float(wanted))
            s = np.float32(1.0 if s == 0 else s)
            scales[r, b] = s
            divisor = np.float32(s * gs)
            codes[r, b * 16 : (b + 1) * 16] = [reference_encode(float(np.float32(v) / divisor)) for v in block]
    return codes, scales


def test_quantize_matches_the_recipe_bit_for_bit():
    weight = torch.randn(6, 64, generator=torch.Generator().manual_seed(2)) * 0.05
    weight[1, :16] = 0.0  # an all-zero block
    weight[2, 16:32] = 1e-9  # a block whose scale underflows e4m3
    q = quantize(weight)
    gs = np.float32(weight.abs().max().item()) / np.float32(2688.0)
    assert q.global_scale.item() == pytest.approx(float(gs), rel=1e-7)
    codes, scales = reference_quantize(weight.numpy(), q.global_scale.numpy())
    assert np.array_equal(unpack_codes(q.packed).numpy(), codes)
    assert np.array_equal(q.scale.float().numpy(), scales)
    assert q.scale[1, 0].item() == 1.0 and q.scale[2, 1].item() == 1.0
    assert (dequantize(q)[1, :16] == 0).all()


def test_round_trip_error_of_gaussian_weights_is_that_of_4_bits():
    weight = torch.randn(256, 512, generator=torch.Generator().manual_seed(3))
    rel = ((dequantize(quantize(weight)) - weight).norm() / weight.norm()).item()
    assert 0.07 < rel < 0.12  # measured 0.094: E2M1 with e4m3 block scales


def test_largest_block_lands_on_448_and_the_largest_value_on_6():
    weight = torch.randn(8, 32, generator=torch.Generator().manual_seed(4))
    q = quantize(weight)
    assert q.scale.float().max().item() == 448.0
    row, col = divmod(int(weight.abs().argmax()), 32)
    assert int(unpack_codes(q.packed)[row, col]) & 7 == 7


def test_fused_parts_share_one_global_scale_of_the_largest_amax():
    q_part, k_part = torch.randn(16, 32) * 0.1, torch.randn(16, 32) * 3
    gs = global_scale_for(q_part, k_part)
    assert gs.dim() == 0 and gs.dtype == torch.float32
    assert gs.item() == pytest.approx(k_part.abs().max().item() / 2688, rel=1e-6)
    fused = quantize(torch.cat([q_part, k_part]), gs)
    alone = quantize(q_part, gs)
    assert torch.equal(fused.packed[:16], alone.packed) and torch.equal(fused.global_scale, gs)


def test_all_zero_weight_quantizes_without_dividing_by_zero():
    q = quantize(torch.zeros(4, 32))
    assert q.global_scale.item() == 1.0
    assert (q.scale.float() == 1.0).all() and (q.packed == 0).all()
    assert (dequantize(q) == 0).all()


def test_a_small_global_scale_saturates_block_scales_at_448():
    weight = torch.full((1, 16), 100.0)
    q = quantize(weight, torch.tensor(1e-3))
    assert q.scale.float().item() == 448.0
    assert dequantize(q).max().item() == pytest.approx(6 * 448 * 1e-3, rel=1e-6)


def test_nbytes_matches_layout():
    q = quantize(torch.randn(48, 96))
    assert q.nbytes == layout.storage_bytes(48, 96)
    assert (q.out_features, q.in_features) == (48, 96)


@pytest.mark.parametrize(
    "weight, message",
    [
        (torch.randn(4, 24), "multiple of 16"),
        (torch.randn(4), "2-D"),
        (torch.randint(0, 5, (4, 32)), "floating-point"),
        (torch.tensor([[float("nan")] * 16]), "NaN or infinite"),
    ],
)
def test_quantize_rejects_bad_input(weight, message):
    with pytest.raises(NVFP4FormatError, match=message):
        quantize(weight)


@pytest.mark.parametrize(
    "global_scale", [torch.tensor(0.0), torch.tensor(-1.0), torch.tensor(float("inf")), torch.ones(2)]
)
def test_quantize_rejects_bad_global_scale(global_scale):
    with pytest.raises(NVFP4FormatError, match="global scale"):
        quantize(torch.randn(2, 16), global_scale)


def _weight(out=4, packed_cols=8, scale_cols=1, packed_dtype=torch.uint8, scale_dtype=torch.float8_e4m3fn, gs=None):
    return dict(
        packed=torch.zeros(out, packed_cols, dtype=packed_dtype),
        scale=torch.zeros(out, scale_cols).to(scale_dtype),
        global_scale=torch.tensor(1.0) if gs is None else gs,
    )


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (_weight(packed_cols=6, scale_cols=1), "multiple of 16"),  # in = 12
        (_weight(packed_cols=8, scale_cols=2), "block scale has shape"),
        (_weight(out=4, packed_cols=16, scale_cols=1), "block scale has shape"),
        (_weight(packed_dtype=torch.int8), "packed weight must be torch.uint8"),
        (_weight(scale_dtype=torch.float32), "block scale must be torch.float8_e4m3fn"),
        (_weight(gs=torch.tensor(1.0, dtype=torch.float64)), "global scale must be torch.float32"),
        (_weight(gs=torch.ones(1)), "0-dim"),
    ],
)
def test_weight_validation(kwargs, message):
    with pytest.raises(NVFP4FormatError, match=message):
        NVFP4Weight(**kwargs)


def test_scale_rows_must_match_weight_rows():
    with pytest.raises(NVFP4FormatError, match="block scale has shape"):
        NVFP4Weight(torch.zeros(4, 8, dtype=torch.uint8), torch.zeros(3, 1).to(torch.float8_e4m3fn), torch.tensor(1.0))
