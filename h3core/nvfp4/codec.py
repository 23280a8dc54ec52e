"""The NVFP4 codec: E2M1 codes, nibble packing, fp8 block scales, quantize and dequantize.

Format facts (../shared/NVFP4.md, ModelOpt layout):

- A code is 4 bits: bit 3 the sign, bits 2..0 index the magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6.
- Along the input axis, element `2j` sits in the LOW nibble of byte `j`, element `2j+1` in the high one.
- 16 consecutive input elements share one `float8_e4m3fn` block scale; one float32 global scale
  (`weight_scale_2`, the DECODE multiplier `amax / (6 * 448)`) covers the tensor.
- Decode, in float32: `W[r, k] = E2M1[code] * (float(weight_scale[r, k // 16]) * weight_scale_2)`.

Quantization follows ModelOpt's recipe; encoding is defined bit for bit by h3's own tests, decoding
matches every library bit for bit. Work on big tensors goes in row chunks so that the temporaries
stay a few tens of MB however large the weight is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch

from h3core.errors import NVFP4FormatError
from h3core.nvfp4 import layout

E2M1_MAX = 6.0
"""Largest E2M1 magnitude."""

E4M3_MAX = 448.0
"""Largest finite float8-e4m3fn value."""

GLOBAL_SCALE_DIVISOR = E2M1_MAX * E4M3_MAX
"""`weight_scale_2 = amax / GLOBAL_SCALE_DIVISOR` (2688): the tensor's amax lands on 6 x 448."""

E2M1_VALUES = torch.tensor(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    dtype=torch.float32,
)
"""The value of each of the 16 codes (code 8 is -0.0)."""

# Round to nearest even onto the magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6: a magnitude moves one code
# up per threshold (a midpoint between neighbours) it passes. At a midpoint the even code wins: the
# comparison is strict where the lower neighbour is even (0, 1, 2, 4) and inclusive where the upper
# one is (1, 2, 4). Above 5 everything saturates at 6.
_THRESHOLDS: tuple[tuple[float, bool], ...] = (  # (midpoint, a tie moves up)
    (0.25, False),
    (0.75, True),
    (1.25, False),
    (1.75, True),
    (2.5, False),
    (3.5, True),
    (5.0, False),
)

_CHUNK_ELEMENTS = 1 << 22
"""Elements per row chunk in quantize/dequantize: 16 MiB float32 temporaries."""


class DecodeTables:
    """The two lookup tables decoding reads, made once per device and kept by whoever owns this
    object (a rank's or a linear's `DeviceKernels`: the lifetime of the model it serves): a byte's
    two E2M1 values (`pairs`, `[256, 2]` float32) and every float8-e4m3fn bit pattern's value
    (`e4m3`, `[256]` float32). A caller without one gets them made for its call alone."""

    def __init__(self) -> None:
        self._pairs: dict[torch.device, torch.Tensor] = {}
        self._e4m3: dict[torch.device, torch.Tensor] = {}

    def pairs(self, device: torch.device) -> torch.Tensor:
        if device not in self._pairs:
            byte = torch.arange(256)
            self._pairs[device] = torch.stack((E2M1_VALUES[byte & 0x0F], E2M1_VALUES[byte >> 4]), dim=-1).to(device)
        return self._pairs[device]

    def e4m3(self, device: torch.device) -> torch.Tensor:
        if device not in self._e4m3:
            bit_patterns = torch.arange(256, dtype=torch.int32).to(torch.uint8)
            self._e4m3[device] = bit_patterns.view(torch.float8_e4m3fn).float().to(device)  # torch's own cast, once
        return self._e4m3[device]


def encode_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Codes 0..15 (uint8) of `x`: round to nearest, ties to even, saturating at +-6.

    The sign follows the sign bit, so -0.0 and small negatives that round to zero give code 8
    (-0), as IEEE rounding would; both decode to zero. NaN encodes as 0; callers reject NaN first.
    """
    magnitude = x.abs()
    codes = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for threshold, tie_goes_up in _THRESHOLDS:
        passed = magnitude >= threshold if tie_goes_up else magnitude > threshold
        codes += passed.to(torch.uint8)
    return codes | (torch.signbit(x).to(torch.uint8) << 3)


def decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """Float32 values of uint8 `codes` (each 0..15)."""
    _check_dtype(codes, torch.uint8, "E2M1 codes")
    return E2M1_VALUES.to(codes.device)[codes.long()]


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """`[..., K]` uint8 codes -> `[..., K/2]` bytes; element `2j` in the low nibble of byte `j`."""
    _check_dtype(codes, torch.uint8, "E2M1 codes")
    if codes.shape[-1] % 2:
        raise NVFP4FormatError(f"cannot pack {codes.shape[-1]} codes per row: the count must be even")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """`[..., K/2]` packed bytes -> `[..., K]` uint8 codes (inverse of `pack_codes`)."""
    _check_dtype(packed, torch.uint8, "packed E2M1 codes")
    pairs = torch.stack((packed & 0x0F, packed >> 4), dim=-1)  # [..., K/2, 2]
    return pairs.reshape(*packed.shape[:-1], packed.shape[-1] * 2)


@dataclass(frozen=True)
class NVFP4Weight:
    """One NVFP4 weight of a Linear `out x in`, in the ModelOpt layout; checked on construction."""

    packed: torch.Tensor
    """uint8 `[out, in/2]`: packed E2M1 codes, row-major (ModelOpt `weight`)."""

    scale: torch.Tensor
    """float8_e4m3fn `[out, in/16]`: block scales, row-major, not swizzled (ModelOpt `weight_scale`)."""

    global_scale: torch.Tensor
    """float32 0-dim: the decode multiplier `amax / (6 * 448)` (ModelOpt `weight_scale_2`)."""

    def __post_init__(self) -> None:
        _check_dtype(self.packed, torch.uint8, "packed weight")
        _check_dtype(self.scale, torch.float8_e4m3fn, "block scale")
        _check_dtype(self.global_scale, torch.float32, "global scale")
        if self.packed.dim() != 2 or self.scale.dim() != 2:
            raise NVFP4FormatError(
                f"packed weight {tuple(self.packed.shape)} and block scale {tuple(self.scale.shape)} "
                f"must both be 2-D [out, in/2] and [out, in/16]"
            )
        if self.global_scale.dim() != 0:
            raise NVFP4FormatError(
                f"global scale must be a 0-dim float32 tensor, got shape {tuple(self.global_scale.shape)}"
            )
        layout.check_width(self.packed.shape[1] * layout.ELEMENTS_PER_BYTE, "packed weight width x 2")
        expected = (self.packed.shape[0], layout.scale_columns(self.in_features))
        if tuple(self.scale.shape) != expected:
            raise NVFP4FormatError(
                f"block scale has shape {tuple(self.scale.shape)} but packed weight "
                f"{tuple(self.packed.shape)} (in={self.in_features}) needs {expected}: one fp8 scale "
                f"per {layout.BLOCK_ELEMENTS} input elements of every row"
            )
        devices = {self.packed.device, self.scale.device, self.global_scale.device}
        if len(devices) > 1:
            raise NVFP4FormatError(f"NVFP4 tensors are on different devices: {sorted(map(str, devices))}")

    @property
    def out_features(self) -> int:
        return self.packed.shape[0]

    @property
    def in_features(self) -> int:
        return self.packed.shape[1] * layout.ELEMENTS_PER_BYTE

    @property
    def nbytes(self) -> int:
        """Bytes of packed codes + block scales + global scale."""
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scale, self.global_scale))

    def to(self, device: torch.device | str) -> "NVFP4Weight":
        return NVFP4Weight(self.packed.to(device), self.scale.to(device), self.global_scale.to(device))


def global_scale_for(*weights: torch.Tensor) -> torch.Tensor:
    """One float32 0-dim global scale (`max amax / (6 * 448)`) shared by all `weights`.

    Fused weights (q|k|v, gate|value) pass all their parts so they share one scale. An all-zero
    input gets 1.0 (any positive value decodes zeros to zeros; 0 would divide by zero on encode).
    """
    if not weights:
        raise ValueError("global_scale_for needs at least one weight")
    amax = torch.stack([w.detach().abs().amax().float() for w in weights]).amax()
    return global_scale_from_amax(amax)


def global_scale_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """`amax / (6 * 448)` as a float32 0-dim tensor; 1.0 for an amax of 0 (no host sync)."""
    amax = amax.float().reshape(())
    return torch.where(amax > 0, amax / GLOBAL_SCALE_DIVISOR, torch.ones_like(amax))


def quantize(weight: torch.Tensor, global_scale: torch.Tensor | None = None) -> NVFP4Weight:
    """Quantize a float `[out, in]` weight to NVFP4 with ModelOpt's recipe.

    `s_b = fp8_e4m3(block_amax / (6 * global_scale))` (saturating at 448; a block whose scale is
    zero, i.e. all-zero or underflowing, gets 1.0), then `code = RNE_fp4(W / (float(s_b) * global_scale))`.
    `global_scale` defaults to `global_scale_for(weight)`; pass the shared one for fused weights.
    """
    if not weight.is_floating_point() or weight.dim() != 2:
        raise NVFP4FormatError(
            f"quantize takes a 2-D floating-point weight [out, in], got {weight.dtype} {tuple(weight.shape)}"
        )
    layout.check_width(weight.shape[1], "weight input width")
    if not bool(torch.isfinite(weight).all()):
        raise NVFP4FormatError("weight has NaN or infinite values; NVFP4 can only hold finite weights")
    if global_scale is None:
        global_scale = global_scale_for(weight)
    _check_global_scale(global_scale, weight.device)
    return quantize_unchecked(weight, global_scale)


def quantize_unchecked(weight: torch.Tensor, global_scale: torch.Tensor, padded_width: int | None = None) -> NVFP4Weight:
    """`quantize` without the input checks (no host sync): for activations on the hot path.

    `padded_width` (a block multiple >= the width): the result is that wide, the extra blocks
    zero codes with zero scales, so they contribute exactly nothing to a product.
    """
    rows, cols = weight.shape
    width = cols if padded_width is None else padded_width
    global_scale = global_scale.detach().to(torch.float32).reshape(())
    packed = torch.empty(rows, layout.packed_bytes(width), dtype=torch.uint8, device=weight.device)
    scale = torch.empty(rows, layout.scale_columns(width), dtype=torch.float8_e4m3fn, device=weight.device)
    if width != cols:
        packed[:, layout.packed_bytes(cols) :] = 0
        scale.view(torch.uint8)[:, layout.scale_columns(cols) :] = 0  # fp8 +0.0
    real_bytes, real_scales = layout.packed_bytes(cols), layout.scale_columns(cols)
    for chunk in _row_chunks(rows, cols):
        packed[chunk, :real_bytes], scale[chunk, :real_scales] = _encode_rows(weight[chunk].float(), global_scale)
    return NVFP4Weight(packed, scale, global_scale)


def _encode_rows(w: torch.Tensor, global_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # w: [r, in] float32 -> packed [r, in/2] uint8, scale [r, in/16] fp8
    rows, cols = w.shape
    blocks = w.view(rows, cols // layout.BLOCK_ELEMENTS, layout.BLOCK_ELEMENTS)  # [r, nb, 16]
    block_amax = blocks.abs().amax(dim=-1)  # [r, nb]
    wanted = block_amax / (E2M1_MAX * global_scale)
    scale = wanted.clamp(max=E4M3_MAX).to(torch.float8_e4m3fn).float()  # RNE onto e4m3, saturating
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)  # zero or underflowing block
    divisor = scale * global_scale  # [r, nb]
    codes = encode_e2m1(blocks / divisor.unsqueeze(-1))  # [r, nb, 16]
    return pack_codes(codes.view(rows, cols)), scale.to(torch.float8_e4m3fn)


def dequantize(w: NVFP4Weight, dtype: torch.dtype = torch.float32, tables: DecodeTables | None = None) -> torch.Tensor:
    """The dense `[out, in]` weight: NVFP4.md's decode formula in float32, then cast to `dtype`."""
    out = torch.empty(w.out_features, w.in_features, dtype=dtype, device=w.packed.device)
    step = row_chunk_size(w.in_features)
    index = torch.empty(min(step, w.out_features) * w.packed.shape[1], dtype=torch.int32, device=out.device)
    work = None if dtype == torch.float32 else torch.empty(min(step, w.out_features) * w.in_features, device=out.device)
    for chunk in _row_chunks(w.out_features, w.in_features):
        target = out[chunk] if work is None else work
        decoded = decode_rows(w.packed[chunk], w.scale[chunk], w.global_scale, target, index, tables)
        if work is not None:
            out[chunk] = decoded
    return out


def decode_rows(
    packed: torch.Tensor,
    scale: torch.Tensor,
    global_scale: torch.Tensor,
    out: torch.Tensor | None = None,
    index_buffer: torch.Tensor | None = None,
    tables: DecodeTables | None = None,
) -> torch.Tensor:
    """Float32 `[r, in]` decode of `r` rows: `E2M1[code] * (float(scale) * global_scale)`.

    `out` (float32, `r * in` elements) and `index_buffer` (int32, `r * in / 2` elements) let a caller
    that decodes chunk after chunk reuse its memory: fresh pages cost more than the arithmetic;
    `tables`: the caller's lookup tables (None: made for this call).
    """
    tables = tables or DecodeTables()
    rows, width = packed.shape[0], packed.shape[1] * layout.ELEMENTS_PER_BYTE
    index = _buffer(index_buffer, packed.numel(), torch.int32, packed.device).copy_(packed.reshape(-1))
    values = _buffer(out, rows * width, torch.float32, packed.device)
    torch.index_select(tables.pairs(packed.device), 0, index, out=values.view(-1, 2))  # low, high nibble
    block_scale = decode_e4m3(scale, tables) * global_scale  # [r, nb]
    blocks = values.view(rows, width // layout.BLOCK_ELEMENTS, layout.BLOCK_ELEMENTS)  # [r, nb, 16]
    blocks.mul_(block_scale.unsqueeze(-1))
    return values.view(rows, width)


def _buffer(given: torch.Tensor | None, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The first `numel` elements of `given` as a flat tensor, or a new one."""
    if given is None:
        return torch.empty(numel, dtype=dtype, device=device)
    assert given.dtype == dtype and given.numel() >= numel and given.is_contiguous()
    return given.reshape(-1)[:numel]


def row_chunk_size(width: int, budget_elements: int = _CHUNK_ELEMENTS) -> int:
    """Rows of a `width`-wide matrix that fit `budget_elements` (at least one)."""
    return max(1, budget_elements // max(1, width))


def _row_chunks(rows: int, width: int) -> Iterator[slice]:
    step = row_chunk_size(width)
    for start in range(0, rows, step):
        yield slice(start, min(rows, start + step))


def decode_e4m3(scale: torch.Tensor, tables: DecodeTables | None = None) -> torch.Tensor:
    """Float32 values of float8-e4m3fn `scale`, by table lookup (the CPU cast is ~15x slower)."""
    index = scale.reshape(-1).view(torch.uint8).int()
    return torch.index_select((tables or DecodeTables()).e4m3(scale.device), 0, index).view(scale.shape)


def _check_dtype(t: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    if t.dtype != dtype:
        raise NVFP4FormatError(f"{what} must be {dtype}, got {t.dtype}")


def _check_global_scale(global_scale: torch.Tensor, device: torch.device) -> None:
    if global_scale.numel() != 1 or not global_scale.is_floating_point():
        raise NVFP4FormatError(
            f"global scale must be one float value, got {global_scale.dtype} {tuple(global_scale.shape)}"
        )
    value = float(global_scale)
    if not (value > 0 and value != float("inf")):
        raise NVFP4FormatError(f"global scale must be a positive finite number, got {value}")
    if global_scale.device != device:
        raise NVFP4FormatError(f"global scale is on {global_scale.device} but the weight is on {device}")
