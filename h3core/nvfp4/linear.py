"""`NVFP4Linear`: a Linear that keeps its weight packed (never a dense copy at rest).

Its tensors are buffers named exactly as ModelOpt names them in a checkpoint, so
`module.state_dict()` keys are ModelOpt keys and `.to(device)` moves them:

| buffer | shape | dtype |
|---|---|---|
| `weight` | `[out, in/2]` | uint8 packed E2M1 codes |
| `weight_scale` | `[out, in/16]` | float8_e4m3fn block scales |
| `weight_scale_2` | `[]` | float32 global (decode) scale |
| `bias` (optional) | `[out]` | float, unquantized |
| `pre_quant_scale` (optional) | `[in]` | float, AWQ activation pre-scale, multiplies `x` first |
| `input_scale` (optional) | `[]` | float32, static activation global scale (fp4 path only) |

Block scales are held once, in the form the device's path reads: row-major `weight_scale` on the
dequant paths; only the 128x4-swizzled `swizzled_weight_scale` (non-persistent) on the fp4 paths,
where `weight_scale` is None after `prepare()`. The other form is derived on demand:
`block_scales` / `nvfp4` unswizzle (a fresh tensor; shards and `state_dict` use it, so files and
shards always see ModelOpt's row-major `weight_scale`), and `prepare()` converts between the forms
when the path changes (a move to another device). On H3's 200 block linears that is 1,204,224,000
bytes less per Ulysses rank on an fp4 GPU (`docs/nvfp4.md`).

`forward` takes one of the paths of `h3core.nvfp4.matmul`; `path` says which and `path_reason`
why, and every forward (and every `forward_rows`) adds one to that path's count in the record the
rank attached (`record`, its runtime's `RankRecord.nvfp4`; None: not counted). `forward_rows` computes some output features only, into a strided
destination if asked (the dequant paths decode just those rows; Ulysses' v GEMM writes into the
all-to-all's send blocks this way). On the fp4 paths (`cuda-fp4-scaled-mm`, `cpu-fp4-emulated`):

- the GEMM's operands (the swizzled block scales, and a zero-padded copy of the packed weight
  only when its shape is not a whole number of GEMM tiles) are built by `prepare()`, which the
  loaders call once at load; they are non-persistent buffers (counted in `resident_bytes`,
  absent from `state_dict`, which carries the row-major `weight_scale` derived from them). A module
  that was never prepared (built by hand, moved to another device) prepares on its first forward.
  After changing the packed weight in place, call `prepare()`.
- the activation global scale is `input_scale` when the checkpoint has one; otherwise the amax
  of the whole logical input: a parallel plan whose ranks each hold part of this linear's input
  sets `agree_amax` (an all-reduce MAX over them), so every rank and the one-rank run use one value.
"""

from __future__ import annotations

from collections import Counter
from functools import partial
from typing import TYPE_CHECKING, Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from h3core.errors import NVFP4FormatError

if TYPE_CHECKING:
    from h3core.span import Span
from h3core.nvfp4 import layout
from h3core.nvfp4.activation import gathered_gemm_operands, quantize_activation, quantize_local_rows
from h3core.nvfp4.codec import NVFP4Weight, global_scale_from_amax, quantize
from h3core.nvfp4.matmul import (
    FP4_PATHS,
    PATH_CUDA_BF16,
    PATH_CUDA_FP4,
    PathChoice,
    choose_path,
    decode_weight,
    dequant_linear,
    emulate_fp4_from_env,
    emulated_scaled_mm_fp4,
    fp4_gemm,
    fp4_gemm_shape,
    prepare_fp4_weight,
    scaled_mm_fp4,
)
from h3core.nvfp4.kernels import DeviceKernels
from h3core.nvfp4.swizzle import unswizzle_block_scales


_FORMAT_BUFFERS = ("weight_scale", "weight_scale_2", "input_scale", "swizzled_weight_scale")
"""Buffers whose dtype is part of the format (the packed `weight` is uint8, which casts leave alone)."""


class GatheredCodes:
    """A linear's input already quantized and gathered (tensor mode's `_GatherRows`): the whole input's
    packed codes [M, K/2] and row-major block scales [M, K/16] at the GEMM's padded width K, with the
    agreed activation global scale, and the dtype the rows had (and, for a linear with a LoRA branch,
    the rows' low-rank projection `A x`). Only `NVFP4Linear` on an fp4 path takes it (`forward` hands
    it to `forward_gathered`)."""

    def __init__(self, codes: NVFP4Weight, dtype: torch.dtype, low_rank: torch.Tensor | None = None):
        self.codes, self.dtype = codes, dtype
        self.low_rank = low_rank
        """Where the linear holds a LoRA branch: its rows' `A x` ([M, R]), gathered with the codes."""

    @property
    def rows(self) -> int:
        return self.codes.packed.shape[0]


class NVFP4Linear(nn.Module):
    """`y = (x * pre_quant_scale) @ W.T + bias` with `W` stored as NVFP4.  x: [..., in] -> [..., out]"""

    fp4_matmul: bool = True
    """Allow the `cuda-fp4-scaled-mm` path where the device has it. Set False (on an instance or the
    class) to keep activations unquantized (weight-only bf16) on Blackwell too."""

    emulate_fp4: bool | None = None
    """On a non-CUDA device, take `cpu-fp4-emulated` instead of `cpu-dequant`. None (default):
    follow the `H3_EMULATE_FP4` environment variable (which spawned ranks inherit)."""

    def __init__(
        self,
        weight: NVFP4Weight,
        bias: torch.Tensor | None = None,
        pre_quant_scale: torch.Tensor | None = None,
        input_scale: torch.Tensor | None = None,
    ):
        super().__init__()
        self.register_buffer("weight", weight.packed)
        self.register_buffer("weight_scale", weight.scale)
        self.register_buffer("weight_scale_2", weight.global_scale)
        self.register_buffer("bias", _checked_vector(bias, weight.out_features, "bias"))
        self.register_buffer("pre_quant_scale", _checked_vector(pre_quant_scale, weight.in_features, "pre_quant_scale"))
        self.register_buffer("input_scale", _checked_scalar(input_scale, "input_scale"))
        self.register_buffer("fp4_weight", None, persistent=False)  # [N, K/2] zero-padded; None: `weight` fits
        self.register_buffer("swizzled_weight_scale", None, persistent=False)
        self.record: Counter[str] | None = None
        """The rank's NVFP4 path record (`h3core.parallel.runtime.RankRecord`): +1 per GEMM call."""
        self.shapes: Counter[tuple[int, int, int]] | None = None
        """The rank's fp4 GEMM shapes (`RankRecord.fp4_shapes`): +1 per (M, N, K) the fp4 GEMM ran."""
        self.register_buffer("decoded_weight", None, persistent=False)  # [out, in] dense, `hold_decoded`
        self.kernels: DeviceKernels | None = None
        """What this linear's device can run (capability, the fp4 GEMM's verdict, the fused quantizer):
        given by its loader (the rank's), else this device's own, asked on first use (`device_kernels`)."""
        self.agree_amax: Callable[[torch.Tensor], torch.Tensor] | None = None
        """Set by a parallel plan whose ranks each hold part of this linear's input: the max of a
        0-dim amax over those ranks. Every rank must then call `forward` (or, holding no rows,
        `join_amax_agreement`) equally often; the fp4 paths without `input_scale` call it."""
        self.lora: nn.Module | None = None
        self.tensor_cut: object | None = None
        """How tensor mode cut this linear (`h3core.parallel.modes.tensor_shards.TensorCut`; None: whole):
        a branch attached later is cut alike (`h3core.lora.tensor`)."""
        """A LoRA branch beside the packed weight (`h3core.lora.branch.LowRankBranch`): `forward` adds `s * B(A x)` to the
        product; the weight, its scales and every path stay as they are."""

    @classmethod
    def from_float(
        cls, weight: torch.Tensor, bias: torch.Tensor | None = None, global_scale: torch.Tensor | None = None
    ) -> "NVFP4Linear":
        """Quantize a dense `[out, in]` weight (pass the shared `global_scale` for fused parts)."""
        return cls(quantize(weight.detach(), global_scale), None if bias is None else bias.detach().clone())

    @classmethod
    def skeleton(
        cls,
        out_features: int,
        in_features: int,
        *,
        bias: bool = False,
        pre_quant_scale: bool = False,
        input_scale: bool = False,
        vector_dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "meta",
    ) -> "NVFP4Linear":
        """A linear of the right shapes and dtypes with uninitialised data (no memory on `meta`).

        Fill it with `load_state_dict(..., assign=True)`; `vector_dtype` is the dtype of the bias
        and pre_quant_scale buffers.
        """
        layout.check_width(in_features, "linear input width")
        weight = NVFP4Weight(
            torch.empty(out_features, layout.packed_bytes(in_features), dtype=torch.uint8, device=device),
            torch.empty(out_features, layout.scale_columns(in_features), dtype=torch.float8_e4m3fn, device=device),
            torch.empty((), dtype=torch.float32, device=device),
        )

        def vector(wanted: bool, size: int) -> torch.Tensor | None:
            return torch.empty(size, dtype=vector_dtype, device=device) if wanted else None

        scalar = torch.empty((), dtype=torch.float32, device=device) if input_scale else None
        return cls(weight, vector(bias, out_features), vector(pre_quant_scale, in_features), scalar)

    @property
    def in_features(self) -> int:
        return self.weight.shape[1] * layout.ELEMENTS_PER_BYTE

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    @property
    def nvfp4(self) -> NVFP4Weight:
        """The packed weight, row-major block scales and global scale: the buffers themselves, except
        on an fp4 path's prepared module, whose scales are unswizzled on demand (`block_scales`)."""
        return NVFP4Weight(self.weight, self.block_scales, self.weight_scale_2)

    @property
    def block_scales(self) -> torch.Tensor:
        """float8_e4m3fn `[out, in/16]` row-major: `weight_scale` where held, else derived from the
        swizzled scales (a new tensor: `weight_scale` is not kept beside them)."""
        if self.weight_scale is not None:
            return self.weight_scale
        rows, width = fp4_gemm_shape(self.out_features, self.in_features)
        padded = unswizzle_block_scales(self.swizzled_weight_scale, rows, layout.scale_columns(width))  # [N, K/16]
        return padded[: self.out_features, : layout.scale_columns(self.in_features)].contiguous()

    def device_kernels(self) -> DeviceKernels:
        """The facts of the device this linear's weight is on: `kernels` when they are that device's,
        else the device's own (asked once and kept: `DeviceKernels.of`)."""
        device = self.weight.device
        if self.kernels is None or not self.kernels.serves(device):
            self.kernels = DeviceKernels.of(device)
        return self.kernels

    @property
    def path_choice(self) -> PathChoice:
        device = self.weight.device
        kernels = self.device_kernels() if device.type == "cuda" else None
        emulate = self.emulate_fp4 if self.emulate_fp4 is not None else emulate_fp4_from_env()
        return choose_path(
            device.type,
            kernels.capability if kernels is not None else None,
            fp4_enabled=self.fp4_matmul,
            emulate_fp4=emulate,
            fp4_kernel_problem=kernels.fp4_gemm_problem if kernels is not None else lambda: None,
        )

    def _fused_quantizer(self, x: torch.Tensor) -> bool:
        """Whether this linear's activation quantizer takes the fused kernel for `x` (CUDA, where it launches)."""
        return x.is_cuda and self.device_kernels().fused_quantizer

    @property
    def path(self) -> str:
        """What `forward` does on this device: one of `matmul.PATHS`."""
        return self.path_choice.path

    @property
    def path_reason(self) -> str:
        return self.path_choice.reason

    @property
    def resident_bytes(self) -> int:
        """Bytes of every buffer this module holds (packed weight, scales, vectors, the fp4 GEMM's
        operands; a LoRA branch beside it is its own, `lora.nbytes`)."""
        return sum(buf.numel() * buf.element_size() for buf in self.buffers(recurse=False))

    def prepare(self) -> None:
        """Hold what this device's path reads, once (the loaders call it at load): on the fp4 paths
        the GEMM's operands, the swizzled scales replacing the row-major ones; on the dequant paths
        the row-major scales (unswizzled back if the module was prepared for an fp4 path). A decoded
        weight (`hold_decoded`) is dropped: call `hold_decoded` again after changing the weight."""
        self.decoded_weight = None
        if self.weight.device.type == "meta":
            return
        if self.path in FP4_PATHS:
            self.fp4_weight, swizzled = prepare_fp4_weight(self.nvfp4)
            self.swizzled_weight_scale, self.weight_scale = swizzled, None
        else:
            self.weight_scale = self.block_scales
            self.fp4_weight = self.swizzled_weight_scale = None

    # --- the decoded weight (Hopper: decode once, not per forward) -----------------------------------

    @staticmethod
    def decoded_bytes(out_features: int, in_features: int, dtype: torch.dtype = torch.bfloat16) -> int:
        """What holding a linear of `out x in` decoded costs (`hold_decoded`)."""
        return out_features * in_features * dtype.itemsize

    @property
    def gemm_dtype(self) -> torch.dtype | None:
        """The dtype the dequant paths' GEMM runs in for this device (bf16 on CUDA; None on the CPU,
        where it is the input's); not defined on the fp4 paths."""
        return torch.bfloat16 if self.path == PATH_CUDA_BF16 else None

    def hold_decoded(self, dtype: torch.dtype | None = None) -> int:
        """Decode the weight once and keep it dense (`decoded_weight`, `[out, in]` in `dtype`: default the
        path's GEMM dtype, bf16 on CUDA), so that the dequant paths multiply with it instead of decoding
        every forward: bitwise the same outputs (`dequant_linear`), `decoded_bytes` more held (counted
        in `resident_bytes`). Returns the bytes now held for it; 0 on the fp4 paths, which read codes."""
        if self.path in FP4_PATHS or self.weight.device.type == "meta":
            self.decoded_weight = None
            return 0
        dtype = dtype or self.gemm_dtype or torch.float32
        self.decoded_weight = decode_weight(self.nvfp4, dtype, tables=self.device_kernels().tables)
        return self.decoded_weight.numel() * self.decoded_weight.element_size()

    def _held_for(self, gemm_dtype: torch.dtype) -> torch.Tensor | None:
        """The decoded weight where it is in the GEMM's dtype (else the weight is decoded as usual)."""
        held = self.decoded_weight
        return held if held is not None and held.dtype == gemm_dtype else None

    @property
    def prepared(self) -> bool:
        """True when the fp4 GEMM's operands exist on the weight's device."""
        scale = self.swizzled_weight_scale
        return scale is not None and scale.device == self.weight.device

    def activation_global_scale(self, x: torch.Tensor) -> torch.Tensor:
        """The fp4 paths' activation global scale for input rows `x` [M, in] (pre-scaled): 0-dim float32."""
        if self.input_scale is not None:
            return self.input_scale
        amax = x.abs().amax().float() if x.numel() else torch.zeros((), device=x.device)
        if self.agree_amax is not None:
            amax = self.agree_amax(amax)
        return global_scale_from_amax(amax)

    def join_amax_agreement(self) -> None:
        """Take part, with an amax of 0, in the scale agreement of a forward this rank does not run
        (it holds none of the input's rows); a no-op wherever `forward` would not agree either."""
        if self.agree_amax is not None and self.input_scale is None and self.path in FP4_PATHS:
            self.agree_amax(torch.zeros((), device=self.weight.device))

    @property
    def rows_apart(self) -> bool:
        """True where output rows computed apart (`forward(x, rows=...)`) are bitwise the same columns
        as the whole `forward(x)`: the dequant paths, where each output row depends on its weight row
        only. False on the fp4 paths: one activation scale covers the whole call (agreed over ranks
        per call), so `rows` there runs the whole product and copies its columns out. False too with a
        LoRA branch: its `B` rows computed apart are not the whole product's columns bit for bit."""
        return self.path not in FP4_PATHS and self.lora is None

    def forward_rows(self, x: torch.Tensor, rows: slice, out: torch.Tensor | None = None) -> torch.Tensor:
        """`self(x, rows=rows, out=out)`: output features `rows` only (see `forward`)."""
        return self(x, rows=rows, out=out)

    def forward(self, x: torch.Tensor, rows: slice | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """x: [..., in] -> [..., out_features], or [..., len(rows)] for output features `rows`.

        `out` (with `rows`; [M, len(rows)], x's dtype, unit column stride, any row stride): where the
        result goes. On the dequant paths (`rows_apart`) only those weight rows are decoded and their
        GEMM writes straight into `out`; on the fp4 paths the whole product runs and its columns are
        copied (`torch._scaled_mm` takes no strided output). Called through the module either way,
        so forward hooks (calibration, `--profile`) see every GEMM. A LoRA branch (`lora`) adds
        `s * B(A x)` of the unscaled input to whatever the path computed (the features `rows` only).
        """
        if isinstance(x, GatheredCodes):
            y = self.forward_gathered([x.codes], x.dtype)
            return y if self.lora is None else self.lora.add_to(y, x.low_rank)
        y = self._forward(x, rows, out)
        if self.lora is not None:
            self.lora.add_to(y.view(-1, y.shape[-1]), self.lora.project(x.reshape(-1, self.in_features)), rows)
        return y

    def _forward(self, x: torch.Tensor, rows: slice | None, out: torch.Tensor | None) -> torch.Tensor:
        """`forward` of the packed weight alone (no branch)."""
        if x.shape[-1] != self.in_features or not x.is_floating_point():
            raise ValueError(
                f"NVFP4Linear({self.in_features} -> {self.out_features}) got input {x.dtype} {tuple(x.shape)}"
            )
        x2 = x.reshape(-1, self.in_features)  # [M, in]
        if self.pre_quant_scale is not None:
            x2 = x2 * self.pre_quant_scale.to(x2.dtype)
        path = self.path
        if not torch.compiler.is_compiling() and self.record is not None:  # compiled: counted per block call (h3core.model.compiled)
            self.record[path] += 1
        if path not in FP4_PATHS and self.weight_scale is None:
            self.prepare()  # prepared for an fp4 path on another device: hold the row-major scales again
        if rows is not None and path not in FP4_PATHS:
            return self._rows_forward(x, x2, rows, out, path)
        if path in FP4_PATHS:
            y = self._fp4_forward(x2, path)
        elif path == PATH_CUDA_BF16:
            y = dequant_linear(x2.to(torch.bfloat16), self.nvfp4, self.bias, decoded_weight=self._held_for(torch.bfloat16), tables=self.device_kernels().tables)
        else:
            y = dequant_linear(x2, self.nvfp4, self.bias, decoded_weight=self._held_for(x2.dtype), tables=self.device_kernels().tables)
        y = y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)  # [..., out]
        if rows is None:
            return y
        return y[..., rows] if out is None else out.copy_(y[..., rows].reshape(out.shape))

    def _rows_forward(self, x: torch.Tensor, x2: torch.Tensor, rows: slice, out: torch.Tensor | None, path: str) -> torch.Tensor:
        """The dequant paths on output features `rows`: decode those weight rows only, GEMM into `out` if given."""
        w = self.nvfp4
        weight = NVFP4Weight(w.packed[rows], w.scale[rows], w.global_scale)
        bias = None if self.bias is None else self.bias[rows]
        gemm_dtype = torch.bfloat16 if path == PATH_CUDA_BF16 else x2.dtype
        direct = out if out is not None and out.dtype == gemm_dtype else None
        held = self._held_for(gemm_dtype)
        y = dequant_linear(x2.to(gemm_dtype), weight, bias, out=direct, decoded_weight=None if held is None else held[rows],
                           tables=self.device_kernels().tables)  # [M, len(rows)]
        if out is not None:
            return y if direct is not None else out.copy_(y)
        return y.to(x.dtype).reshape(*x.shape[:-1], y.shape[-1])

    def _fp4_forward(self, x2: torch.Tensor, path: str) -> torch.Tensor:
        act_global = self.activation_global_scale(x2)  # before any early return: peers may wait on it
        if x2.shape[0] == 0:
            return x2.new_empty(0, self.out_features)
        _, width = fp4_gemm_shape(self.out_features, self.in_features)
        act_packed, act_scale = quantize_activation(x2, act_global, width, fused=self._fused_quantizer(x2))  # [M, K/2], swizzled [M, K/16]
        return self._fp4_gemm(act_packed, act_scale, act_global, path, x2.dtype)

    def _fp4_gemm(self, act_packed: torch.Tensor, act_scale: torch.Tensor, act_global: torch.Tensor, path: str, dtype: torch.dtype) -> torch.Tensor:
        if not self.prepared:
            self.prepare()
        weight = self.fp4_weight if self.fp4_weight is not None else self.weight
        if not torch.compiler.is_compiling() and self.shapes is not None:  # compiled: not recorded (docs/compile.md)
            self.shapes[(act_packed.shape[0], *fp4_gemm_shape(self.out_features, self.in_features))] += 1
        gemm, out_dtype = (scaled_mm_fp4, torch.bfloat16) if path == PATH_CUDA_FP4 else (partial(emulated_scaled_mm_fp4, tables=self.device_kernels().tables), dtype)
        return fp4_gemm(
            act_packed, act_scale, act_global, weight, self.swizzled_weight_scale, self.weight_scale_2, self.out_features,
            self.bias, out_dtype=out_dtype, gemm=gemm,
        )

    # --- tensor mode: quantize local rows, gather codes + scales, then the GEMM ----------------------

    def quantize_input(self, x_local: torch.Tensor) -> NVFP4Weight:
        """This rank's input rows [m, in] (pre-scaled here like `forward`) as NVFP4 codes + row-major
        scales at the GEMM's padded width, quantized with the activation global scale of the WHOLE
        gathered input: `activation_global_scale` agrees the amax over the ranks (`agree_amax`,
        which must span the gather group) unless `input_scale` is set. Every rank of the group calls
        it, rows or none. Gather the results (packed bytes and the scales' bytes, rank order) and
        pass them to `forward_gathered`: bitwise `forward(gathered rows)`.  Fp4 paths only."""
        x2 = x_local.reshape(-1, self.in_features)
        if self.pre_quant_scale is not None:
            x2 = x2 * self.pre_quant_scale.to(x2.dtype)
        act_global = self.activation_global_scale(x2)
        _, width = fp4_gemm_shape(self.out_features, self.in_features)
        return quantize_local_rows(x2, act_global, width, fused=self._fused_quantizer(x2))

    def forward_gathered(self, parts: list[NVFP4Weight], dtype: torch.dtype) -> torch.Tensor:
        """The product of the gathered `quantize_input` results (rank order), in `dtype` ([M, out]):
        bitwise the `forward` of the gathered rows in that dtype, on the fp4 paths."""
        path = self.path
        if path not in FP4_PATHS:
            raise ValueError(f"forward_gathered is for the fp4 paths; this linear takes {path}")
        if not torch.compiler.is_compiling() and self.record is not None:  # compiled: counted per block call (h3core.model.compiled)
            self.record[path] += 1
        act_packed, act_scale = gathered_gemm_operands(parts)
        if act_packed.shape[0] == 0:
            return torch.empty(0, self.out_features, dtype=dtype, device=act_packed.device)
        return self._fp4_gemm(act_packed, act_scale, parts[0].global_scale, path, dtype).to(dtype)

    def _save_to_state_dict(self, destination, prefix, keep_vars):  # type: ignore[no-untyped-def]
        """ModelOpt's names and layout whatever this module holds: a prepared fp4 module (no
        `weight_scale`) writes its row-major scales derived from the swizzled ones, in place."""
        for name, buf in self._buffers.items():
            if name in self._non_persistent_buffers_set:
                continue
            if name == "weight_scale" and buf is None and self.swizzled_weight_scale is not None:
                buf = self.block_scales
            if buf is not None:
                destination[prefix + name] = buf if keep_vars else buf.detach()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):  # type: ignore[no-untyped-def]
        """Loading into a prepared fp4 module: the row-major `weight_scale` it reads comes back first
        (and the fp4 operands go: the next forward, or `prepare()`, rebuilds them)."""
        if self.weight_scale is None and self.swizzled_weight_scale is not None:
            self.weight_scale = self.block_scales
            self.fp4_weight = self.swizzled_weight_scale = None
        self.decoded_weight = None  # decoded from the weight being replaced
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)

    def _apply(self, fn, recurse: bool = True):  # type: ignore[no-untyped-def]
        """`.to(device)` moves every buffer; `.to(dtype)` / `.half()` / `.bfloat16()` cast only `bias` and
        `pre_quant_scale`: the format tensors keep their dtypes (fp8 scales, float32 global scales),
        because a cast would make them something else than NVFP4 (and lose global-scale bits)."""
        kept: dict[str, tuple[torch.dtype, torch.Size]] = {}
        for name in _FORMAT_BUFFERS:
            buf = self._buffers.get(name)
            if buf is not None and buf.is_floating_point():
                kept[name] = (buf.dtype, buf.shape)
                self._buffers[name] = buf.reshape(-1).view(torch.uint8)  # bytes: no dtype to convert
        try:
            return super()._apply(fn, recurse)
        finally:
            for name, (dtype, shape) in kept.items():
                self._buffers[name] = self._buffers[name].view(dtype).reshape(shape)

    def extra_repr(self) -> str:
        extras = [name for name in ("bias", "pre_quant_scale", "input_scale") if getattr(self, name) is not None]
        return f"in_features={self.in_features}, out_features={self.out_features}, nvfp4" + "".join(
            f", {name}" for name in extras
        )


def _checked_vector(vector: torch.Tensor | None, size: int, name: str) -> torch.Tensor | None:
    if vector is None:
        return None
    if not vector.is_floating_point() or tuple(vector.shape) != (size,):
        raise NVFP4FormatError(f"{name} must be a float vector of {size}, got {vector.dtype} {tuple(vector.shape)}")
    return vector


def _checked_scalar(scalar: torch.Tensor | None, name: str) -> torch.Tensor | None:
    """A one-element float scale as a float32 0-dim tensor (ModelOpt writes `[]`; some exports `[1]`)."""
    if scalar is None:
        return None
    if not scalar.is_floating_point() or scalar.numel() != 1:
        raise NVFP4FormatError(f"{name} must be one float value, got {scalar.dtype} {tuple(scalar.shape)}")
    return scalar.to(torch.float32).reshape(())


class DenseLinear(nn.Module):
    """The unquantized linear a checkpoint may hold beside NVFP4 ones (`h3core.nvfp4.io.CheckpointWeights`), kept in its stored dtype (bf16 on disk stays bf16 in memory) and cast
    to the activation dtype when used."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.register_buffer("weight", weight)  # [out, in]
        self.register_buffer("bias", bias)  # [out] or None
        self.lora: nn.Module | None = None  # a LoRA branch beside the weight (`h3core.lora.branch.LowRankBranch`)
        self.tensor_cut: object | None = None  # how tensor mode cut it (None: whole), as NVFP4Linear's

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., in] -> [..., out]
        bias = None if self.bias is None else self.bias.to(x.dtype)
        y = F.linear(x, self.weight.to(x.dtype), bias)
        if self.lora is not None:
            self.lora.add_to(y.view(-1, y.shape[-1]), self.lora.project(x.reshape(-1, self.in_features)))
        return y

    def rows(self, spans: "Sequence[Span]") -> "DenseLinear":
        """A column-parallel shard: output rows `spans` (bias rows with them), compact copies."""
        take = lambda t: torch.cat([t[s.start : s.stop] for s in spans])  # noqa: E731
        return DenseLinear(take(self.weight), None if self.bias is None else take(self.bias))

    def columns(self, span: "Span") -> "DenseLinear":
        """A row-parallel shard: input columns `span`, no bias (added once after the reduction)."""
        return DenseLinear(self.weight[:, span.start : span.stop].contiguous())
