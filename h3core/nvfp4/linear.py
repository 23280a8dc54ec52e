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

`forward` takes one of three paths (see `h3core.nvfp4.matmul`); `path` says which and
`path_reason` why. On the fp4 path the swizzled block scales are built once per device and kept
as a non-persistent buffer (counted in `resident_bytes`, absent from `state_dict`).
"""

from __future__ import annotations

import torch
from torch import nn

from h3core.errors import NVFP4FormatError
from h3core.nvfp4 import layout
from h3core.nvfp4.codec import NVFP4Weight, quantize
from h3core.nvfp4.matmul import (
    PATH_CUDA_BF16,
    PATH_CUDA_FP4,
    PathChoice,
    choose_path,
    dequant_linear,
    fp4_kernel_problem,
    fp4_linear,
)
from h3core.nvfp4.swizzle import swizzle_block_scales


_FORMAT_BUFFERS = ("weight_scale", "weight_scale_2", "input_scale", "swizzled_weight_scale")
"""Buffers whose dtype is part of the format (the packed `weight` is uint8, which casts leave alone)."""


class NVFP4Linear(nn.Module):
    """`y = (x * pre_quant_scale) @ W.T + bias` with `W` stored as NVFP4.  x: [..., in] -> [..., out]"""

    fp4_matmul: bool = True
    """Allow the `cuda-fp4-scaled-mm` path where the device has it. Set False (on an instance or the
    class) to keep activations unquantized (weight-only bf16) on Blackwell too, e.g. for parity runs."""

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
        self.register_buffer("swizzled_weight_scale", None, persistent=False)
        self._swizzled_from: tuple[int, int, torch.device] | None = None

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
        """The packed weight, block scales and global scale (the buffers themselves, not copies)."""
        return NVFP4Weight(self.weight, self.weight_scale, self.weight_scale_2)

    @property
    def path_choice(self) -> PathChoice:
        device = self.weight.device
        capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
        return choose_path(
            device.type,
            capability,
            self.in_features,
            self.out_features,
            fp4_enabled=self.fp4_matmul,
            fp4_kernel_problem=lambda: fp4_kernel_problem(device),
        )

    @property
    def path(self) -> str:
        """`cpu-dequant`, `cuda-dequant-bf16` or `cuda-fp4-scaled-mm`: what `forward` does on this device."""
        return self.path_choice.path

    @property
    def path_reason(self) -> str:
        return self.path_choice.reason

    @property
    def resident_bytes(self) -> int:
        """Bytes of every buffer this module holds (packed weight, scales, vectors, swizzled scales)."""
        return sum(buf.numel() * buf.element_size() for buf in self.buffers())

    def prepare(self) -> None:
        """Build what the current device's path needs (the swizzled scales on the fp4 path) now."""
        if self.path == PATH_CUDA_FP4:
            self._swizzled_scale()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features or not x.is_floating_point():
            raise ValueError(
                f"NVFP4Linear({self.in_features} -> {self.out_features}) got input {x.dtype} {tuple(x.shape)}"
            )
        x2 = x.reshape(-1, self.in_features)  # [M, in]
        if self.pre_quant_scale is not None:
            x2 = x2 * self.pre_quant_scale.to(x2.dtype)
        path = self.path
        if path == PATH_CUDA_FP4:
            y = fp4_linear(x2, self.nvfp4, self._swizzled_scale(), self.bias, self.input_scale)
        elif path == PATH_CUDA_BF16:
            y = dequant_linear(x2.to(torch.bfloat16), self.nvfp4, self.bias)
        else:
            y = dequant_linear(x2, self.nvfp4, self.bias)
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)  # [..., out]

    def _swizzled_scale(self) -> torch.Tensor:
        source = (self.weight_scale.data_ptr(), self.weight_scale._version, self.weight_scale.device)
        if self.swizzled_weight_scale is None or self._swizzled_from != source:
            self.swizzled_weight_scale = swizzle_block_scales(self.weight_scale)
            self._swizzled_from = source
        return self.swizzled_weight_scale

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
