"""The fp4 paths' activation quantizer: rows `[M, K]` -> the operands the fp4 GEMM reads.

`quantize_activation(x, act_global, width)` returns the packed E2M1 codes `[M, width/2]` (element
`2j` in the low nibble of byte `j`, as `codec.pack_codes`) and the flat 128x4-swizzled fp8 block
scales of the zero-padded `[M, width/16]` scale matrix (as `swizzle.swizzle_block_scales`), with
`width` the GEMM's padded K (extra blocks: zero codes, zero scales). Two implementations, bit for
bit the same:

- eager (`eager_quantize_activation`, the reference and the fallback): the codec's
  `quantize_unchecked` in row chunks, then `swizzle_block_scales`. Every step is a separate torch
  kernel over the chunk: at H3's shapes a call launches hundreds to thousands of kernels and
  re-reads the activation (in fp32) about twenty times (`docs/nvfp4.md`, "the activation quantizer").
- fused (`fused_quantize_activation`): one Triton kernel that reads each activation element once
  and writes the packed codes and the already-swizzled scales (padding included) directly, so the
  outputs need no zero-fill: one launch. Its arithmetic is the codec's operation for operation
  (IEEE divisions, the e4m3 rounding done on the float's bits, round-to-nearest-even everywhere),
  which is what makes it bit-identical; `tests/unit/test_nvfp4_fused_quantizer.py` proves that on
  the CPU under Triton's interpreter (`TRITON_INTERPRET=1`).

`quantize_activation` takes the fused kernel on CUDA when triton imports (`FUSED_ON_CUDA`), the
eager codec otherwise. `quantize_local_rows` is the row-local form tensor mode can gather
(codes + row-major scales instead of bf16 rows; see its docstring for the precondition).
"""

from __future__ import annotations

import functools
import importlib.util

import torch

from h3core.nvfp4 import layout
from h3core.nvfp4.codec import NVFP4Weight, quantize_unchecked
from h3core.nvfp4.swizzle import TILE_COLUMNS, TILE_ROWS, swizzle_block_scales, swizzled_size

FUSED_ON_CUDA = True
"""Use the fused Triton quantizer for CUDA activations when triton imports (False: always eager)."""

FUSED_BLOCK_ROWS = 32
"""Rows per Triton program (a divisor of the 128-row scale tile)."""

FUSED_BLOCK_SCALES = 16
"""16-element blocks per Triton program along K (a multiple of the 4-column scale tile): 256 elements."""


def quantize_activation(x: torch.Tensor, act_global: torch.Tensor, width: int, *, fused: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] float, act_global float32 0-dim -> (packed [M, width/2] uint8, swizzled scales of
    [M, width/16], flat fp8). Fused on CUDA where the kernel launches (`fused`: the caller's device
    says, `DeviceKernels.fused_quantizer`; None: triton importable here), else eager; same bits."""
    if _takes_fused(x, fused):
        return fused_quantize_activation(x, act_global, width)
    return eager_quantize_activation(x, act_global, width)


def _takes_fused(x: torch.Tensor, fused: bool | None) -> bool:
    return x.is_cuda and FUSED_ON_CUDA and (triton_available() if fused is None else fused)


def eager_quantize_activation(x: torch.Tensor, act_global: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference: the codec's `quantize_unchecked` padded to `width`, then `swizzle_block_scales`."""
    act = quantize_unchecked(x, act_global, padded_width=width)
    return act.packed, swizzle_block_scales(act.scale)


def quantize_local_rows(x_local: torch.Tensor, act_global: torch.Tensor, width: int, *, fused: bool | None = None) -> NVFP4Weight:
    """This rank's rows quantized for a gather: packed codes [m, width/2] and row-major (not swizzled)
    scales [m, width/16], so that tensor mode can all-gather codes + scales (a quarter and a
    thirty-second of the bf16 rows' bytes) instead of bf16 rows.

    Precondition: `act_global` is the activation global scale of the WHOLE gathered input, agreed by
    every rank of the gather before quantizing (the linear's `input_scale`, or `amax / (6 * 448)`
    with the amax all-reduced (MAX) over the group: `NVFP4Linear.agree_amax`). Under it, every
    quantized element depends only on its own 16-element block and that scale, so concatenating
    the ranks' results in rank order is bitwise `quantize_unchecked(gathered rows)`, and
    `swizzle_block_scales` of the gathered scales is the GEMM's operand (`gathered_gemm_operands`).
    With per-rank scales the bits differ (and so would the product). Fused on CUDA where triton
    imports (`fused_quantize_rows`; `fused` as in `quantize_activation`), else the codec; same bits.
    """
    if _takes_fused(x_local, fused):
        return fused_quantize_rows(x_local, act_global, width)
    return quantize_unchecked(x_local, act_global, padded_width=width)


def gathered_gemm_operands(parts: list[NVFP4Weight]) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp4 GEMM's activation operands from gathered `quantize_local_rows` results, in rank
    order: (packed [M, width/2], swizzled scales of the [M, width/16] matrix)."""
    packed = torch.cat([p.packed for p in parts])
    scales = torch.cat([p.scale.view(torch.uint8) for p in parts]).view(torch.float8_e4m3fn)
    return packed, swizzle_block_scales(scales)


@functools.cache
def triton_available() -> bool:
    """True when triton imports (the fused quantizer's only requirement besides a CUDA tensor)."""
    if importlib.util.find_spec("triton") is None:
        return False
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # a broken install (missing libraries) counts as absent: the eager codec serves
        return False
    return True


def fused_quantize_activation(x: torch.Tensor, act_global: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The eager result in one Triton launch (any device Triton runs on: CUDA, or the CPU under
    `TRITON_INTERPRET=1`).  x: [M, K] fp32/bf16/fp16 with unit column stride."""
    packed, swizzled = _fused(x, act_global, width, swizzled=True)
    return packed, swizzled.view(torch.float8_e4m3fn)


def fused_quantize_rows(x: torch.Tensor, act_global: torch.Tensor, width: int) -> NVFP4Weight:
    """`quantize_unchecked(x, act_global, padded_width=width)` in one Triton launch: packed codes
    [M, width/2] and row-major (not swizzled) scales [M, width/16], what tensor mode gathers."""
    packed, scales = _fused(x, act_global, width, swizzled=False)
    global_scale = act_global.detach().to(device=x.device, dtype=torch.float32).reshape(())
    return NVFP4Weight(packed, scales.view(torch.float8_e4m3fn).view(x.shape[0], layout.scale_columns(width)), global_scale)


def _fused(x: torch.Tensor, act_global: torch.Tensor, width: int, *, swizzled: bool) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = x.shape
    layout.check_width(cols, "activation width")
    layout.check_width(width, "padded width")
    assert width >= cols, f"padded width {width} < activation width {cols}"
    if x.stride(1) != 1:
        x = x.contiguous()
    scale_cols = layout.scale_columns(width)
    padded_rows, padded_scale_cols = _ceil_to(rows, TILE_ROWS), _ceil_to(scale_cols, TILE_COLUMNS)
    packed = torch.empty(rows, layout.packed_bytes(width), dtype=torch.uint8, device=x.device)
    scales = torch.empty(swizzled_size(rows, scale_cols) if swizzled else rows * scale_cols, dtype=torch.uint8, device=x.device)
    global_scale = act_global.detach().to(device=x.device, dtype=torch.float32).reshape(1)
    fused_quantize_launch(x, global_scale, packed, scales, layout.scale_columns(cols), scale_cols, padded_rows, padded_scale_cols, swizzled)
    return packed, scales


@torch.library.custom_op("h3::fused_nvfp4_quantize", mutates_args=("packed", "scales"))
def fused_quantize_launch(x: torch.Tensor, global_scale: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, cols_scales: int,
                          scale_cols: int, padded_rows: int, padded_scale_cols: int, swizzled: bool) -> None:
    """One launch of the Triton kernel, writing `packed` and `scales` (allocated by `_fused`).

    A torch custom op, so that tensors without data (`FakeTensorMode`: the dry run) pass through it
    by its registered fake, which writes nothing, as every other op passes through its own."""
    rows, cols = x.shape
    grid = (padded_rows // FUSED_BLOCK_ROWS, -(-padded_scale_cols // FUSED_BLOCK_SCALES))
    _kernel()[grid](
        x, x.stride(0), global_scale, packed, scales,
        rows, cols, cols_scales, scale_cols, packed.shape[1], padded_rows, padded_scale_cols,
        BLOCK_R=FUSED_BLOCK_ROWS, BLOCK_C=FUSED_BLOCK_SCALES, SWIZZLED=swizzled,
    )


@fused_quantize_launch.register_fake
def _fused_quantize_no_data(x: torch.Tensor, global_scale: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, cols_scales: int,
                            scale_cols: int, padded_rows: int, padded_scale_cols: int, swizzled: bool) -> None:
    return None


def _ceil_to(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _kernel():  # type: ignore[no-untyped-def]
    """The Triton kernel (`h3core.nvfp4.fused_kernel`, imported on first use). `triton.jit` decides at
    import whether the kernel is interpreted (`TRITON_INTERPRET=1`); a module imported under the other
    mode is imported again."""
    import importlib

    from triton import knobs

    from h3core.nvfp4 import fused_kernel

    if fused_kernel.INTERPRETED != bool(knobs.runtime.interpret):
        fused_kernel = importlib.reload(fused_kernel)
    return fused_kernel.quantize_kernel
