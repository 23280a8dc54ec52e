"""The fused activation quantizer's Triton kernel (see `h3core.nvfp4.activation`, which launches it).

Imported only where triton is installed and a fused quantization is asked for. Arithmetic mirrors
`h3core.nvfp4.codec` operation for operation: `tl.div_rn` (IEEE division) where the codec divides,
fp32 products where it multiplies, the e4m3 rounding done on the float's bits (round to nearest
even, as torch's cast), the E2M1 thresholds counted as `codec.encode_e2m1` counts them.
"""

import triton
import triton.language as tl
from triton import knobs

INTERPRETED = bool(knobs.runtime.interpret)
"""Whether this import built interpreted kernels (`TRITON_INTERPRET=1`)."""


@triton.jit
def e4m3_rne(w):
    """Round w (fp32, 0 <= w <= 448) to float8-e4m3fn, nearest-even, as torch's cast does:
    returns (the fp8 bit pattern as int32, its value as fp32). Done on the float's bits so no
    compiler or device rounding mode can change it."""
    bits = w.to(tl.int32, bitcast=True)
    exponent = (bits >> 23) & 0xFF
    # normal e4m3 (w >= 2^-6, biased fp32 exponent >= 121): keep 3 of 23 mantissa bits, RNE
    lsb = (bits >> 20) & 1
    rounded = (bits + 0x7FFFF + lsb) & -1048576  # ~0xFFFFF
    normal_bits = ((((rounded >> 23) & 0xFF) - 120) << 3) | ((rounded >> 20) & 7)  # e4m3 bias 7: 127 - 7 = 120
    normal_value = rounded.to(tl.float32, bitcast=True)
    # subnormal e4m3 (w < 2^-6): multiples of 2^-9, RNE of the integer w * 2^9
    mantissa = tl.where(exponent > 0, (bits & 0x7FFFFF) | 0x800000, bits & 0x7FFFFF)
    shift = tl.minimum(tl.maximum(141 - tl.maximum(exponent, 1), 0), 30)  # value = mantissa * 2^(e - 150)
    kept = mantissa >> shift
    rest = mantissa & ((1 << shift) - 1)
    half = (1 << shift) >> 1
    kept = kept + ((rest > half) | ((rest == half) & ((kept & 1) == 1))).to(tl.int32)
    sub_value = kept.to(tl.float32) * 0.001953125  # 2^-9, exact
    is_normal = exponent >= 121
    return tl.where(is_normal, normal_bits, kept), tl.where(is_normal, normal_value, sub_value)


@triton.jit
def e2m1_codes(q):
    """The codec's `encode_e2m1`: round |q| to the E2M1 magnitudes (ties to even, saturating at
    6) by counting thresholds passed, sign bit from q's own sign bit (-0.0 gives code 8)."""
    magnitude = tl.abs(q)
    codes = (magnitude > 0.25).to(tl.int32)
    codes += (magnitude >= 0.75).to(tl.int32)
    codes += (magnitude > 1.25).to(tl.int32)
    codes += (magnitude >= 1.75).to(tl.int32)
    codes += (magnitude > 2.5).to(tl.int32)
    codes += (magnitude >= 3.5).to(tl.int32)
    codes += (magnitude > 5.0).to(tl.int32)
    sign = (q.to(tl.int32, bitcast=True) >> 31) & 1
    return codes | (sign << 3)


@triton.jit
def quantize_kernel(
    x_ptr, x_row_stride, global_ptr, packed_ptr, swizzled_ptr,
    rows, cols, real_blocks, blocks, packed_cols, padded_rows, padded_blocks,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, SWIZZLED: tl.constexpr = True,
):
    # One program: BLOCK_R rows x BLOCK_C 16-element blocks, over the scale matrix padded to
    # whole 128x4 tiles (its padding gets zero scales; rows >= `rows` get no codes).
    row = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # [R]
    block = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)  # [C]
    element = block[:, None] * 16 + tl.arange(0, 16)[None, :]  # [C, 16]
    real_row = row < rows
    loaded = real_row[:, None, None] & (element < cols)[None, :, :]
    x = tl.load(x_ptr + row[:, None, None] * x_row_stride + element[None, :, :], mask=loaded, other=0.0).to(tl.float32)  # [R, C, 16]

    global_scale = tl.load(global_ptr)
    wanted = tl.div_rn(tl.max(tl.abs(x), axis=2), 6.0 * global_scale)  # [R, C]: block amax / (6 gs)
    scale_bits, scale = e4m3_rne(tl.minimum(wanted, 448.0))
    underflow = scale == 0.0  # an all-zero or underflowing block gets scale 1.0 (fp8 0x38)
    scale_bits = tl.where(underflow, 0x38, scale_bits)
    scale = tl.where(underflow, 1.0, scale)
    real = real_row[:, None] & (block < real_blocks)[None, :]
    scale_bits = tl.where(real, scale_bits, 0)  # padding blocks and rows: fp8 +0.0

    codes = e2m1_codes(tl.div_rn(x, (scale * global_scale)[:, :, None]))  # [R, C, 16]
    low, high = tl.split(tl.reshape(codes, (BLOCK_R, BLOCK_C, 8, 2)))  # element 2j, 2j + 1
    packed = (low | (high << 4)).to(tl.uint8)  # [R, C, 8]
    byte = block[:, None] * 8 + tl.arange(0, 8)[None, :]  # [C, 8]
    stored = real_row[:, None, None] & (block < blocks)[None, :, None]
    tl.store(packed_ptr + row[:, None, None] * packed_cols + byte[None, :, :], packed, mask=stored)

    if SWIZZLED:
        # 128x4 swizzle: tiles row-tile major; in a tile, (r, c) at (r % 32) * 16 + (r // 32) * 4 + c
        tile = (row // 128)[:, None] * (padded_blocks // 4) + (block // 4)[None, :]
        offset = tile * 512 + ((row % 32) * 16 + ((row % 128) // 32) * 4)[:, None] + (block % 4)[None, :]
        inside = (row < padded_rows)[:, None] & (block < padded_blocks)[None, :]
        tl.store(swizzled_ptr + offset, scale_bits.to(tl.uint8), mask=inside)
    else:
        # row-major [rows, blocks] (tensor mode gathers these, then swizzles the whole matrix)
        inside = real_row[:, None] & (block < blocks)[None, :]
        tl.store(swizzled_ptr + row[:, None] * blocks + block[None, :], scale_bits.to(tl.uint8), mask=inside)

