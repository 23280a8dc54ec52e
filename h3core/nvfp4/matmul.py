"""The matmul paths of an NVFP4 linear, and which one a device takes.

- `cpu-dequant` (any non-CUDA device): decode the weight to the activations' dtype, `F.linear`.
- `cuda-dequant-bf16` (CUDA before compute capability 10, or a shape/kernel the fp4 GEMM cannot
  take): decode to bf16 and multiply with bf16 activations. Weight-only: activations stay bf16.
- `cuda-fp4-scaled-mm` (compute capability >= 10): quantize the activations to NVFP4 too (their
  global scale is `input_scale` when the checkpoint has one, else the amax of this call's input)
  and run `torch._scaled_mm` on `float4_e2m1fn_x2` operands with 128x4-swizzled fp8 block scales;
  the two global scales multiply the bf16 result afterwards. cuBLAS needs `in % 32 == 0` and
  `out % 16 == 0`; other shapes (e.g. a row shard with an odd number of blocks) take the bf16 path.

The dequant paths decode the weight in row chunks of at most `DEQUANT_CHUNK_ELEMENTS` and write
each chunk's output columns, so the transient dense weight is bounded however large the layer is
(peak extra memory: one chunk, not the whole dense weight).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from h3core.nvfp4 import layout
from h3core.nvfp4.codec import NVFP4Weight, decode_rows, global_scale_for, quantize_unchecked, row_chunk_size
from h3core.nvfp4.swizzle import swizzle_block_scales

PATH_CPU_DEQUANT = "cpu-dequant"
PATH_CUDA_BF16 = "cuda-dequant-bf16"
PATH_CUDA_FP4 = "cuda-fp4-scaled-mm"
PATHS = (PATH_CPU_DEQUANT, PATH_CUDA_BF16, PATH_CUDA_FP4)

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


@dataclass(frozen=True)
class PathChoice:
    """The matmul path a linear takes, and why."""

    path: str
    reason: str


def choose_path(
    device_type: str,
    capability: tuple[int, int] | None,
    in_features: int,
    out_features: int,
    *,
    fp4_enabled: bool,
    fp4_kernel_problem: Callable[[], str | None],
) -> PathChoice:
    """Pick the path for a linear of `out x in` on a device. `fp4_kernel_problem` is asked last, lazily."""
    if device_type != "cuda":
        return PathChoice(PATH_CPU_DEQUANT, f"device type {device_type!r}: decode and F.linear")
    if capability is None or tuple(capability) < FP4_MIN_CAPABILITY:
        return PathChoice(PATH_CUDA_BF16, f"compute capability {capability} < {FP4_MIN_CAPABILITY}: weight-only bf16")
    if not fp4_enabled:
        return PathChoice(PATH_CUDA_BF16, "fp4 matmul disabled on this linear (fp4_matmul=False)")
    if in_features % FP4_IN_MULTIPLE or out_features % FP4_OUT_MULTIPLE:
        return PathChoice(
            PATH_CUDA_BF16,
            f"shape {out_features}x{in_features}: the fp4 GEMM needs in % {FP4_IN_MULTIPLE} == 0 "
            f"and out % {FP4_OUT_MULTIPLE} == 0",
        )
    problem = fp4_kernel_problem()
    if problem is not None:
        return PathChoice(PATH_CUDA_BF16, f"fp4 _scaled_mm unavailable here: {problem}")
    return PathChoice(PATH_CUDA_FP4, f"compute capability {capability}: NVFP4 x NVFP4 torch._scaled_mm")


def dequant_linear(
    x: torch.Tensor, w: NVFP4Weight, bias: torch.Tensor | None, chunk_elements: int | None = None
) -> torch.Tensor:
    """`(x @ dequantize(w).T) + bias` in `x.dtype`, decoding `w` in row chunks.  x: [M, in] -> [M, out]"""
    if chunk_elements is None:
        chunk_elements = DEQUANT_CHUNK_ELEMENTS.get(x.device.type, DEQUANT_CHUNK_ELEMENTS["cpu"])
    step = min(row_chunk_size(w.in_features, chunk_elements), w.out_features)
    index = torch.empty(step * w.packed.shape[1], dtype=torch.int32, device=x.device)
    decoded = torch.empty(step * w.in_features, dtype=torch.float32, device=x.device)
    dense = decoded if x.dtype == torch.float32 else torch.empty(step * w.in_features, dtype=x.dtype, device=x.device)
    if step == w.out_features:
        out = F.linear(x, _decode_chunk(w, slice(0, step), index, decoded, dense))
    else:
        out = torch.empty(x.shape[0], w.out_features, dtype=x.dtype, device=x.device)
        for start in range(0, w.out_features, step):
            rows = slice(start, min(w.out_features, start + step))
            out[:, rows] = F.linear(x, _decode_chunk(w, rows, index, decoded, dense))
    # The bias is added after the GEMM, never fused into it: tensor mode adds a row-parallel
    # layer's bias after the reduction, and one rank must round exactly as that does.
    return out if bias is None else out.add_(_cast(bias, x.dtype))


def _decode_chunk(
    w: NVFP4Weight, rows: slice, index: torch.Tensor, decoded: torch.Tensor, dense: torch.Tensor
) -> torch.Tensor:
    """Rows `rows` of `w` decoded (float32, in `decoded`) and cast into `dense`'s dtype: [r, in]."""
    values = decode_rows(w.packed[rows], w.scale[rows], w.global_scale, decoded, index)
    if dense is decoded:
        return values
    target = dense[: values.numel()].view(values.shape)
    return target.copy_(values)


def _cast(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return None if t is None else t.to(dtype)


def fp4_linear(
    x: torch.Tensor,
    w: NVFP4Weight,
    swizzled_weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    input_scale: torch.Tensor | None,
) -> torch.Tensor:
    """NVFP4 x NVFP4 GEMM on Blackwell; returns bf16.  x: [M, in] -> [M, out]"""
    act_global = input_scale if input_scale is not None else global_scale_for(x)
    xq = quantize_unchecked(x, act_global)
    out = scaled_mm_fp4(xq.packed, swizzle_block_scales(xq.scale), w.packed, swizzled_weight_scale)
    out = out * (xq.global_scale * w.global_scale)  # [M, out] bf16, product taken in fp32
    return out if bias is None else out + bias.to(out.dtype)


def scaled_mm_fp4(
    a_packed: torch.Tensor, a_scale_swizzled: torch.Tensor, b_packed: torch.Tensor, b_scale_swizzled: torch.Tensor
) -> torch.Tensor:
    """`A @ B.T` of two NVFP4 matrices with block scales only (no global scales), in bf16.

    a_packed: [M, K/2] uint8 (activations), b_packed: [N, K/2] uint8 (weight), both row-major;
    scales: flat 128x4-swizzled fp8 of their `[M, K/16]` and `[N, K/16]` matrices. cuBLAS wants
    the first operand row-major and the second column-major: the weight's transpose view is.
    """
    return torch._scaled_mm(
        a_packed.view(torch.float4_e2m1fn_x2),  # [M, K/2] row-major
        b_packed.view(torch.float4_e2m1fn_x2).t(),  # [K/2, N] column-major
        a_scale_swizzled,
        b_scale_swizzled,
        out_dtype=torch.bfloat16,
    )


_kernel_problems: dict[torch.device, str | None] = {}


def fp4_kernel_problem(device: torch.device) -> str | None:
    """None if the fp4 `_scaled_mm` runs on `device` (probed once, cached), else why not."""
    if not hasattr(torch, "float4_e2m1fn_x2") or not hasattr(torch, "_scaled_mm"):
        return f"torch {torch.__version__} has no float4_e2m1fn_x2 / _scaled_mm"
    if device not in _kernel_problems:
        _kernel_problems[device] = _probe_fp4_kernel(device)
    return _kernel_problems[device]


def _probe_fp4_kernel(device: torch.device) -> str | None:
    rows, width = 128, 64  # the smallest shape with whole 128x4 scale tiles
    packed = torch.zeros(rows, layout.packed_bytes(width), dtype=torch.uint8, device=device)
    scale = torch.ones(rows, layout.scale_columns(width), device=device).to(torch.float8_e4m3fn)
    try:
        swizzled = swizzle_block_scales(scale)
        scaled_mm_fp4(packed, swizzled, packed, swizzled)
        torch.cuda.synchronize(device)
    except (RuntimeError, NotImplementedError, TypeError) as err:
        return f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    return None
