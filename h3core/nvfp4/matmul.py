"""The matmul paths of an NVFP4 linear, which one a device takes, and a record of what ran.

- `cpu-dequant` (any non-CUDA device): decode the weight to the activations' dtype, `F.linear`.
- `cuda-dequant-bf16` (CUDA before compute capability 10, or the fp4 GEMM disabled or not
  runnable here): decode to bf16 and multiply with bf16 activations. Weight-only.
- `cuda-fp4-scaled-mm` (compute capability >= 10, and the fp4 GEMM self-test passed,
  `h3core.nvfp4.selftest`): quantize the activations to NVFP4 too (one fused Triton kernel where
  triton imports, `h3core.nvfp4.activation`) and run the block-scaled fp4 GEMM on
  `float4_e2m1fn_x2` operands with 128x4-swizzled fp8 block scales. The two global scales make
  alpha = act_global * weight_global, an fp32 product applied to the fp32 accumulator inside the
  GEMM, and the bias is added there too, before the one rounding to bf16 (`scaled_mm_fp4`: torch's
  two-level NVFP4 recipe, `F.scaled_mm` with [block, tensor] scales; on a torch without it, an fp32
  GEMM output scaled and biased in fp32, then rounded once).
- `cpu-fp4-emulated` (any non-CUDA device, when switched on: `NVFP4Linear.emulate_fp4` or
  `H3_EMULATE_FP4=1`): the fp4 path step for step — same activation global scale, same padded
  operands, same swizzled scales, alpha and bias in fp32 — with the GEMM emulated from exactly the
  bytes cuBLAS would read (`emulated_scaled_mm_fp4`), accumulated in float32 and returned in the
  activations' dtype. It lets the Gloo tier prove the fp4 path's parity on a CPU.

Activation global scale (fp4 paths): the checkpoint's `input_scale` where it has one, else
`amax / (6 * 448)` of the whole logical input, agreed by the ranks that each hold part of it
(`NVFP4Linear.agree_amax`): so it is the same on every rank and in the one-rank run.

Shapes: cuBLAS's NVFP4 GEMM wants K (input width) a multiple of 32 and N (output rows) a multiple
of 16. Other shapes (a row-parallel shard with an odd number of 16-element blocks, which ragged
splits produce) are padded with zero blocks — zero codes with zero scales, exact — so every shape
takes the same path and no reduction mixes fp4 and bf16 partials. The padded weight (only when
padding is needed) and the swizzled weight scales are built once at load (`prepare_fp4_weight`,
counted in the module's resident bytes), never in the denoising loop; an `NVFP4Linear` on an fp4
path then holds only the swizzled scales (see `h3core.nvfp4.linear`).

The dequant paths decode the weight in row chunks whose starts are multiples of 128 rows (so the
chunk GEMM's output pitch stays 16-byte aligned and cuBLAS keeps its fast kernels); a tail of
fewer than 128 rows joins the chunk before it, so no chunk GEMM is narrower than 128 rows. Whether a
chunk's GEMM sums in the order of one whole GEMM is the BLAS's choice: bitwise on an AVX2 Xeon, not
on an AVX-512 one (MKL picks kernels by the output's width); every chunking is within the reordering
bound of the whole product (tests prove it), and a given device's budget fixes the chunking.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from h3core import settings
from h3core.nvfp4 import layout
from h3core.nvfp4.activation import quantize_activation
from h3core.nvfp4.codec import DecodeTables, NVFP4Weight, decode_rows
from h3core.nvfp4.swizzle import swizzle_block_scales, unswizzle_block_scales

PATH_CPU_DEQUANT = "cpu-dequant"
PATH_CPU_FP4_EMULATED = "cpu-fp4-emulated"
PATH_CUDA_BF16 = "cuda-dequant-bf16"
PATH_CUDA_FP4 = "cuda-fp4-scaled-mm"
PATHS = (PATH_CPU_DEQUANT, PATH_CPU_FP4_EMULATED, PATH_CUDA_BF16, PATH_CUDA_FP4)
FP4_PATHS = (PATH_CUDA_FP4, PATH_CPU_FP4_EMULATED)
"""The paths that quantize activations (and so need an activation global scale)."""

EMULATE_FP4_ENV = settings.EMULATE_FP4
"""1: linears on the CPU take `cpu-fp4-emulated` instead of `cpu-dequant` (also in spawned ranks)."""

FP4_MIN_CAPABILITY = (10, 0)
"""Blackwell (B200 10.0, RTX PRO 6000 12.0) and later have block-scaled FP4 tensor cores."""

FP4_IN_MULTIPLE = 32
"""cuBLAS's NVFP4 GEMM wants K (input width) a multiple of 32: 16 packed bytes per row."""

FP4_OUT_MULTIPLE = 16
"""... and N (output width) a multiple of 16."""

DEQUANT_CHUNK_ELEMENTS = {"cuda": 1 << 24, "cpu": 1 << 22}
"""Weight elements decoded at a time on the dequant paths, per device type: 64 MiB of float32
temporaries on CUDA (ten chunks for a 7168 x 21504 weight keep the GEMMs large), 16 MiB on the CPU
(cache-sized chunks measured fastest there; whole-weight decoding was ~1.5x slower)."""

DEQUANT_CHUNK_ROWS = 128
"""Chunks start on multiples of this many rows and are never narrower (see the module docstring)."""


@dataclass(frozen=True)
class PathChoice:
    """The matmul path a linear takes, and why."""

    path: str
    reason: str


def choose_path(
    device_type: str,
    capability: tuple[int, int] | None,
    *,
    fp4_enabled: bool,
    emulate_fp4: bool,
    fp4_kernel_problem: Callable[[], str | None],
) -> PathChoice:
    """Pick the path of a linear on a device. Shape plays no part: the fp4 GEMM's operands are padded.
    `fp4_kernel_problem` (`h3core.nvfp4.kernels.DeviceKernels.fp4_gemm_problem`: the fp4 GEMM self-test's
    verdict) is asked last, lazily."""
    if device_type != "cuda":
        if emulate_fp4:
            return PathChoice(PATH_CPU_FP4_EMULATED, f"device type {device_type!r}, fp4 emulation on: the fp4 path with an emulated GEMM")
        return PathChoice(PATH_CPU_DEQUANT, f"device type {device_type!r}: decode and F.linear")
    if capability is None or tuple(capability) < FP4_MIN_CAPABILITY:
        return PathChoice(PATH_CUDA_BF16, f"compute capability {capability} < {FP4_MIN_CAPABILITY}: weight-only bf16")
    if not fp4_enabled:
        return PathChoice(PATH_CUDA_BF16, "fp4 matmul disabled on this linear (fp4_matmul=False)")
    problem = fp4_kernel_problem()
    if problem is not None:
        return PathChoice(PATH_CUDA_BF16, f"fp4 _scaled_mm unavailable here: {problem}")
    return PathChoice(PATH_CUDA_FP4, f"compute capability {capability}: NVFP4 x NVFP4 torch._scaled_mm")


def emulate_fp4_from_env() -> bool:
    """`H3_EMULATE_FP4` as a bool (unset: False); a malformed value is a ConfigError naming it."""
    return settings.emulate_fp4()


# --- the dequant paths -------------------------------------------------------------------------------


def dequant_row_chunks(out_features: int, in_features: int, budget_elements: int) -> list[slice]:
    """Row ranges to decode one at a time: `budget_elements // in_features` rows rounded down to a
    multiple of 128 (at least 128); a tail of fewer than 128 rows joins the chunk before it."""
    step = max(DEQUANT_CHUNK_ROWS, budget_elements // max(1, in_features) // DEQUANT_CHUNK_ROWS * DEQUANT_CHUNK_ROWS)
    starts = list(range(0, out_features, step))
    if len(starts) > 1 and out_features - starts[-1] < DEQUANT_CHUNK_ROWS:
        starts.pop()
    stops = starts[1:] + [out_features]
    return [slice(a, b) for a, b in zip(starts, stops)]


def dequant_linear(
    x: torch.Tensor,
    w: NVFP4Weight,
    bias: torch.Tensor | None,
    chunk_elements: int | None = None,
    out: torch.Tensor | None = None,
    decoded_weight: torch.Tensor | None = None,
    tables: DecodeTables | None = None,
) -> torch.Tensor:
    """`(x @ dequantize(w).T) + bias` in `x.dtype`, decoding `w` in row chunks (with the caller's
    lookup `tables`: `h3core.nvfp4.codec.DecodeTables`).  x: [M, in] -> [M, out]

    `out` ([M, out] in x's dtype, unit column stride, any row stride, e.g. a view into an
    all-to-all's send buffer): each chunk's GEMM writes its columns there directly (BLAS takes the
    row stride as its leading dimension, so nothing is copied) and `out` is returned.

    `decoded_weight` ([out, in] in x's dtype, contiguous: `decode_weight(w, x.dtype)`, held by the
    caller): its row chunks replace the decoded ones. The GEMMs are the same calls on the same
    values with the same shapes and strides, so the result is bitwise the decoding one's.
    """
    if chunk_elements is None:
        chunk_elements = DEQUANT_CHUNK_ELEMENTS.get(x.device.type, DEQUANT_CHUNK_ELEMENTS["cpu"])
    chunks = dequant_row_chunks(w.out_features, w.in_features, chunk_elements)
    if decoded_weight is not None:
        chunk_weight = lambda chunk: decoded_weight[chunk]  # noqa: E731 - [r, in] contiguous rows
    else:
        rows = max(c.stop - c.start for c in chunks)
        index = torch.empty(rows * w.packed.shape[1], dtype=torch.int32, device=x.device)
        decoded = torch.empty(rows * w.in_features, dtype=torch.float32, device=x.device)
        dense = decoded if x.dtype == torch.float32 else torch.empty(rows * w.in_features, dtype=x.dtype, device=x.device)
        tables = tables or DecodeTables()
        chunk_weight = lambda chunk: _decode_chunk(w, chunk, index, decoded, dense, tables)  # noqa: E731
    if out is None and len(chunks) == 1:
        out = F.linear(x, chunk_weight(chunks[0]))
    else:
        out = torch.empty(x.shape[0], w.out_features, dtype=x.dtype, device=x.device) if out is None else out
        for chunk in chunks:  # the same GEMM as F.linear, its result written in place: bitwise equal
            torch.mm(x, chunk_weight(chunk).t(), out=out[:, chunk])
    # The bias is added after the GEMM, never fused into it: tensor mode adds a row-parallel
    # layer's bias after the reduction, and one rank must round exactly as that does.
    return out if bias is None else out.add_(bias.to(x.dtype))


def decode_weight(w: NVFP4Weight, dtype: torch.dtype, chunk_elements: int = DEQUANT_CHUNK_ELEMENTS["cuda"], tables: DecodeTables | None = None) -> torch.Tensor:
    """The whole weight decoded once, `[out, in]` in `dtype` (what `dequant_linear`'s chunks hold, each
    row decoded in float32 and cast exactly as there), decoded chunk by chunk to bound the float32
    temporaries."""
    dense = torch.empty(w.out_features, w.in_features, dtype=dtype, device=w.packed.device)
    tables = tables or DecodeTables()
    for chunk in dequant_row_chunks(w.out_features, w.in_features, chunk_elements):
        dense[chunk] = decode_rows(w.packed[chunk], w.scale[chunk], w.global_scale, tables=tables)
    return dense


def _decode_chunk(
    w: NVFP4Weight, rows: slice, index: torch.Tensor, decoded: torch.Tensor, dense: torch.Tensor, tables: DecodeTables
) -> torch.Tensor:
    """Rows `rows` of `w` decoded (float32, in `decoded`) and cast into `dense`'s dtype: [r, in]."""
    values = decode_rows(w.packed[rows], w.scale[rows], w.global_scale, decoded, index, tables)
    if dense is decoded:
        return values
    target = dense[: values.numel()].view(values.shape)
    return target.copy_(values)


# --- the fp4 paths -------------------------------------------------------------------------------------


def fp4_gemm_shape(out_features: int, in_features: int) -> tuple[int, int]:
    """(N, K) of the fp4 GEMM for a linear `out x in`: each rounded up to cuBLAS's multiple."""
    return _ceil_to(out_features, FP4_OUT_MULTIPLE), _ceil_to(in_features, FP4_IN_MULTIPLE)


def prepare_fp4_weight(w: NVFP4Weight) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The weight as the fp4 GEMM reads it, built once at load.

    Returns (packed weight zero-padded to `[N, K/2]` of `fp4_gemm_shape`, or None when the shape
    already fits and the module's own `weight` serves; the flat 128x4-swizzled block scales of
    the zero-padded `[N, K/16]` scale matrix).
    """
    rows, width = fp4_gemm_shape(w.out_features, w.in_features)
    packed = None
    scale = w.scale
    if (rows, width) != (w.out_features, w.in_features):
        packed = w.packed.new_zeros(rows, layout.packed_bytes(width))
        packed[: w.out_features, : w.packed.shape[1]] = w.packed
        padded = torch.zeros(rows, layout.scale_columns(width), dtype=torch.uint8, device=w.scale.device)
        padded[: w.out_features, : w.scale.shape[1]] = w.scale.view(torch.uint8)
        scale = padded.view(torch.float8_e4m3fn)
    return packed, swizzle_block_scales(scale)


def fp4_linear(
    x: torch.Tensor,
    w: NVFP4Weight,
    gemm_weight: torch.Tensor,
    gemm_weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    act_global: torch.Tensor,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    gemm: Callable[..., torch.Tensor] | None = None,
) -> torch.Tensor:
    """NVFP4 x NVFP4 product of `x` with `w`, in `out_dtype`.  x: [M, in] -> [M, out]

    `gemm_weight`, `gemm_weight_scale`: `w` as `prepare_fp4_weight` laid it out (padded packed
    codes, or `w.packed` itself; swizzled scales). `act_global`: the activation global scale.
    `gemm`: `scaled_mm_fp4` (default, CUDA) or `emulated_scaled_mm_fp4`. Only `w.out_features`,
    `w.in_features` and `w.global_scale` are read from `w` (its block scales may be any form).
    """
    _, width = fp4_gemm_shape(w.out_features, w.in_features)
    act_packed, act_scale = quantize_activation(x, act_global, width)  # [M, K/2], swizzled [M, K/16]
    return fp4_gemm(
        act_packed, act_scale, act_global, gemm_weight, gemm_weight_scale, w.global_scale, w.out_features, bias,
        out_dtype=out_dtype, gemm=gemm,
    )


def fp4_gemm(
    act_packed: torch.Tensor,
    act_scale_swizzled: torch.Tensor,
    act_global: torch.Tensor,
    gemm_weight: torch.Tensor,
    gemm_weight_scale: torch.Tensor,
    weight_global: torch.Tensor,
    out_features: int,
    bias: torch.Tensor | None,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    gemm: Callable[..., torch.Tensor] | None = None,
) -> torch.Tensor:
    """The GEMM of already-quantized activations (`act_packed` [M, K/2] with the swizzled scales of
    its [M, K/16] matrix, K = the padded width) with a prepared weight (`gemm_weight` [N, K/2],
    `gemm_weight_scale` swizzled): alpha = act_global * weight_global and the bias applied in fp32
    inside the GEMM, one rounding to `out_dtype`.  -> [M, out_features] (a column view when N is padded)"""
    rows = gemm_weight.shape[0]  # N, padded to the GEMM's multiple
    if bias is not None:
        bias = bias.to(out_dtype)
        if rows != out_features:  # padded output columns get a zero bias and are dropped below
            bias = F.pad(bias, (0, rows - out_features))
    out = (gemm or scaled_mm_fp4)(
        act_packed, act_scale_swizzled, gemm_weight, gemm_weight_scale, out_dtype, a_global=act_global, b_global=weight_global, bias=bias
    )
    return out[:, :out_features]  # [M, out]


def _has_two_level_nvfp4() -> bool:
    """torch's `F.scaled_mm` with the NVFP4 two-level recipe ([block 1x16, tensor] scales per operand)."""
    scaling = getattr(F, "ScalingType", None)
    return hasattr(F, "scaled_mm") and scaling is not None and hasattr(scaling, "BlockWise1x16") and hasattr(F, "SwizzleType")


def scaled_mm_fp4(
    a_packed: torch.Tensor,
    a_scale_swizzled: torch.Tensor,
    b_packed: torch.Tensor,
    b_scale_swizzled: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
    *,
    a_global: torch.Tensor | None = None,
    b_global: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """`alpha * (A @ B.T) + bias` of two NVFP4 matrices, rounded once to `out_dtype`.

    a_packed: [M, K/2] uint8 (activations), b_packed: [N, K/2] uint8 (weight), both row-major;
    scales: flat 128x4-swizzled fp8 of their `[M, K/16]` and `[N, K/16]` matrices. cuBLAS wants
    the first operand row-major and the second column-major: the weight's transpose view is.
    `a_global`, `b_global`: float32 0-dim global scales (both or neither): alpha = their fp32
    product, applied to the fp32 accumulator, never to a rounded result. `bias`: [N] in `out_dtype`.
    """
    a = a_packed.view(torch.float4_e2m1fn_x2)  # [M, K/2] row-major
    b = b_packed.view(torch.float4_e2m1fn_x2).t()  # [K/2, N] column-major
    if a_global is None and b_global is None and bias is None:
        return torch._scaled_mm(a, b, a_scale_swizzled, b_scale_swizzled, out_dtype=out_dtype)
    a_global = _global_or_one(a_global, a_packed.device)
    b_global = _global_or_one(b_global, a_packed.device)
    if _has_two_level_nvfp4() and out_dtype != torch.float32:
        block, tensor = F.ScalingType.BlockWise1x16, F.ScalingType.TensorWise
        swizzled, plain = F.SwizzleType.SWIZZLE_32_4_4, F.SwizzleType.NO_SWIZZLE
        return F.scaled_mm(
            a, b, [a_scale_swizzled, a_global], [block, tensor], [b_scale_swizzled, b_global], [block, tensor],
            swizzle_a=[swizzled, plain], swizzle_b=[swizzled, plain], bias=bias, output_dtype=out_dtype,
        )
    out = torch._scaled_mm(a, b, a_scale_swizzled, b_scale_swizzled, out_dtype=torch.float32)  # [M, N] fp32
    return _epilogue(out, a_global * b_global, bias, out_dtype)


def _global_or_one(scale: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    return torch.ones((), dtype=torch.float32, device=device) if scale is None else scale.to(torch.float32).reshape(())


def _epilogue(acc: torch.Tensor, alpha: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """`alpha * acc + bias` in fp32 on the fp32 accumulator, then one rounding to `out_dtype`."""
    out = acc.mul_(alpha)
    if bias is not None:
        out = out.add_(bias.to(torch.float32))
    return out.to(out_dtype)


def emulated_scaled_mm_fp4(
    a_packed: torch.Tensor,
    a_scale_swizzled: torch.Tensor,
    b_packed: torch.Tensor,
    b_scale_swizzled: torch.Tensor,
    out_dtype: torch.dtype = torch.float32,
    *,
    a_global: torch.Tensor | None = None,
    b_global: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    tables: DecodeTables | None = None,
) -> torch.Tensor:
    """What `scaled_mm_fp4` computes, on any device, from the very bytes it would read (`tables`: the
    caller's decode lookup tables, None: made for this call).

    Both operands are decoded exactly (E2M1 x e4m3 products fit float32) with their block scales
    read back from the swizzled layout as cuBLAS defines it, then multiplied in float32 (the
    weight decoded chunk by chunk, as on the dequant paths); alpha and bias in fp32, one rounding.
    -> [M, N] in `out_dtype`
    """
    rows_a, rows_b, width = a_packed.shape[0], b_packed.shape[0], layout.unpacked_width(a_packed.shape[1])
    one = torch.ones((), dtype=torch.float32, device=a_packed.device)
    a_scale = unswizzle_block_scales(a_scale_swizzled, rows_a, layout.scale_columns(width))
    b_scale = unswizzle_block_scales(b_scale_swizzled, rows_b, layout.scale_columns(width))
    a = decode_rows(a_packed, a_scale, one, tables=tables)  # [M, K] float32
    acc = dequant_linear(a, NVFP4Weight(b_packed, b_scale, one), None, tables=tables)  # [M, N] float32
    alpha = _global_or_one(a_global, acc.device) * _global_or_one(b_global, acc.device)
    return _epilogue(acc, alpha, bias, out_dtype)


def _ceil_to(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple
