"""Attention kernel dispatch: one interface (`AttentionKernel`, `attend`) in front of the backends, and
a record of the kernels that really ran (diffusers' `dispatch_attention_fn`).

Layout everywhere in h3 is sequence-first without a batch dimension: `q, k, v: [S, H, Dh]`, full
bidirectional attention over the packed sequence (no mask: segments are packed with no padding, so
there is nothing to mask). Backends:

- `sdpa`  (default) `torch.nn.functional.scaled_dot_product_attention` on 4-D `[1, H, S, Dh]`
  views of the inputs (no copy). PyTorch's fused kernels (flash, memory-efficient and cuDNN on
  CUDA; flash on the CPU) take 4-D input only: 3-D input silently runs the math kernel, which on
  CUDA upcasts to fp32 and materialises `[H, S, S]` scores (49 GB per copy at 56 x 14,855). On
  CUDA the call runs under h3's rule (`h3core.model.attention.sdpa_rule`): fused kernels only.
- `math`  the reference: softmax(q k^T / sqrt(Dh)) v in float32, then cast back.
- `sage2` SageAttention 2 (`sageattn`, built from github.com/thu-ml/SageAttention), CUDA only.
- `flash` FlashAttention 2 (package `flash-attn`, function `flash_attn.flash_attn_func`), CUDA only.

Whether a backend can run at all is checked before any rank starts (`h3core.model.attention.checks`).

What ran: every call adds one to its kernel's count in the record it is given (each rank's
`RankRecord`, on its runtime: `h3core.parallel.runtime`). For `sdpa` the kernel is PyTorch's own
dispatch decision (`torch._fused_sdp_choice`) on the very tensors of the call, so a report built
from the record names the kernels the run used, not those of a probe.

Decisions are cached where their owner lives: an `AttentionKernel` (one per attention module of a
model) keeps its `SdpaChoices`, the dispatcher's decision per call signature (shapes, strides,
dtype, device, enabled-backend flags) and h3's rule per (device, dtype, width, length), for the
model's lifetime; nothing here outlives the model it serves. `DeviceKernels` (the model's device's
facts, given by its loader) answer the rule's questions about the GPU.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from h3core.errors import BackendUnavailable
from h3core.model.attention.sdpa_rule import SdpaChoice, sdpa_choice_for
from h3core.nvfp4.kernels import DeviceKernels

BACKENDS = ("sdpa", "math", "sage2", "flash")

KERNEL_NAMES = {"math": "h3 math (fp32 softmax)", "sage2": "SageAttention2", "flash": "flash-attn"}
"""The kernel each non-sdpa backend runs (one each)."""


class SdpaChoices:
    """What `sdpa` takes for a call, decided once per call signature and kept by its owner (module
    docstring): the dispatcher's kernel (`kernel_of`) and, on CUDA, h3's rule (`rule`). `device`:
    the facts of the GPU the rule is for (None: asked from the tensors' device when first needed)."""

    def __init__(self, device: DeviceKernels | None = None):
        self.device = device
        self._kernels: dict[tuple, str] = {}
        self._rules: dict[tuple, SdpaChoice] = {}

    def kernel_of(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str:
        """`sdpa_kernel_of(q, k, v)`, decided once per call signature (the enabled-backend flags included)."""
        key = (*(_signature(t) for t in (q, k, v)), _enabled_sdp_flags())
        if key not in self._kernels:
            self._kernels[key] = sdpa_kernel_of(q, k, v)
        return self._kernels[key]

    def rule(self, q4: torch.Tensor) -> SdpaChoice | None:
        """The rule for a CUDA call with q4 [1, H, S, Dh] (decided once per device, dtype, width and
        length); None off CUDA. A call where no fused kernel fits is refused, never run as math."""
        if q4.device.type != "cuda":
            return None
        key = (q4.device, q4.dtype, q4.shape[-1], q4.shape[-2])
        if key not in self._rules:
            self._rules[key] = sdpa_choice_for(self._device_of(q4.device), q4.dtype, q4.shape[-1], q4.shape[-2])
        choice = self._rules[key]
        if not choice.backends:
            raise BackendUnavailable(f"attention backend 'sdpa' has no fused kernel here ({choice.reason}); use --dtype bf16 or another --attention")
        return choice

    def _device_of(self, device: torch.device) -> DeviceKernels:
        if self.device is None or not self.device.serves(device):
            self.device = DeviceKernels.of(device)
        return self.device


class AttentionKernel(nn.Module):
    """The one attention interface every processor calls: q, k, v [S, H, Dh] -> [S, H, Dh] with the
    named `backend`. `record`: the rank's kernel record, attached by its runtime (None: not counted);
    `choices`: this kernel's cached SDPA decisions (module docstring)."""

    def __init__(self, backend: str = "sdpa"):
        super().__init__()
        self.backend = backend
        self.record: Counter[str] | None = None
        self.choices = SdpaChoices()

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return attend(q, k, v, self.backend, self.record, self.choices)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: str = "sdpa", record: Counter[str] | None = None,
           choices: SdpaChoices | None = None) -> torch.Tensor:
    """Full attention. q, k, v: [S, H, Dh] (same S for all three) -> [S, H, Dh]. `record`: the rank's
    kernel record (`h3core.parallel.runtime.RankRecord.attention`), one count per call; `choices`:
    the caller's cached SDPA decisions (None: decided for this call alone)."""
    return _IMPLS[backend](q, k, v, record, choices or SdpaChoices())


def _sdpa_views(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """What `_sdpa` hands to SDPA: [S, H, Dh] -> [1, H, S, Dh] views, no copy."""
    return tuple(t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, record: Counter[str] | None, choices: SdpaChoices) -> torch.Tensor:
    q4, k4, v4 = _sdpa_views(q, k, v)
    choice = choices.rule(q4)
    if choice is None:  # the CPU: flash is its only fused kernel and PyTorch's order already takes it
        _count(record, lambda: choices.kernel_of(q4, k4, v4))
        return F.scaled_dot_product_attention(q4, k4, v4)[0].transpose(0, 1)  # [S, H, Dh]
    with sdpa_kernel(choice.sdp_backends, set_priority=True):  # the record and the call see the same rule
        _count(record, lambda: choices.kernel_of(q4, k4, v4))
        return F.scaled_dot_product_attention(q4, k4, v4)[0].transpose(0, 1)  # [S, H, Dh]


def _math(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, record: Counter[str] | None, choices: SdpaChoices) -> torch.Tensor:
    qf, kf, vf = (t.float().transpose(0, 1) for t in (q, k, v))  # [H, S, Dh]
    scores = qf @ kf.transpose(-1, -2) / math.sqrt(q.shape[-1])  # [H, S, S]
    _count(record, lambda: KERNEL_NAMES["math"])
    return (scores.softmax(dim=-1) @ vf).transpose(0, 1).to(q.dtype)


def _sage2(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, record: Counter[str] | None, choices: SdpaChoices) -> torch.Tensor:
    from sageattention import sageattn

    _count(record, lambda: KERNEL_NAMES["sage2"])
    # "NHD" = [batch, seq, heads, dim]
    return sageattn(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), tensor_layout="NHD", is_causal=False)[0]


def _flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, record: Counter[str] | None, choices: SdpaChoices) -> torch.Tensor:
    from flash_attn import flash_attn_func

    _count(record, lambda: KERNEL_NAMES["flash"])
    # [batch, seq, heads, dim]
    return flash_attn_func(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), causal=False)[0]


_IMPLS: dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Counter[str] | None, SdpaChoices], torch.Tensor]] = {
    "sdpa": _sdpa,
    "math": _math,
    "sage2": _sage2,
    "flash": _flash,
}


# --- what ran --------------------------------------------------------------------------------------


def _count(record: Counter[str] | None, kernel: Callable[[], str]) -> None:
    """One more call of `kernel()` in `record` (asked only when there is a record; inside a compiled
    block the block's caller counts, `h3core.model.compiled`)."""
    if not torch.compiler.is_compiling() and record is not None:
        record[kernel()] += 1


def sdpa_kernel_of(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str:
    """`sdpa:<kernel>` that `scaled_dot_product_attention(q, k, v)` dispatches to for these tensors.

    Asks PyTorch's dispatcher (`torch._fused_sdp_choice`, private: a failure is reported as
    unknown, never guessed); `torch.nn.attention.sdpa_kernel` contexts are honoured. Not cached
    (an `SdpaChoices` keeps the answers of the calls it serves).
    """
    try:
        choice = int(torch._fused_sdp_choice(q, k, v))
        names = {int(getattr(SDPBackend, n)): n.lower() for n in dir(SDPBackend) if n.isupper()}
        return f"sdpa:{names.get(choice, choice)}"
    except Exception as err:  # private API: absent or changed in this torch
        return f"sdpa:unknown ({type(err).__name__})"


def _signature(t: torch.Tensor) -> tuple:
    return (tuple(t.shape), t.stride(), t.dtype, t.device, t.storage_offset() % 16)


def _enabled_sdp_flags() -> tuple[bool, ...]:
    cuda = torch.backends.cuda
    return (cuda.flash_sdp_enabled(), cuda.mem_efficient_sdp_enabled(), cuda.math_sdp_enabled(), cuda.cudnn_sdp_enabled())


def planned_sdpa_kernel(device: torch.device, dtype: torch.dtype, heads: int, head_dim: int) -> str:
    """The kernel `attend(..., "sdpa")` will dispatch to for `[S, H, Dh]` inputs laid out as the model
    passes them, before any run (memory estimates); reports use the record of the real calls."""
    q = torch.zeros(16, 3, heads, head_dim, device=device, dtype=dtype)[:, 0]  # [S, H, Dh], strided like q of q|k|v
    return sdpa_kernel_of(*_sdpa_views(q, q, q))


def scores_bytes(attention: str, device: str, dtype: torch.dtype, heads: int, tokens: int, head_dim: int) -> int:
    """Bytes of the [heads, S, S] scores (and their softmax) one call holds at once, where the kernel
    materialises them: the `math` backend always; `sdpa` when PyTorch's dispatcher picks its math
    kernel for inputs laid out as `_sdpa` passes them (`planned_sdpa_kernel`; with the 4-D views it
    passes, the CPU takes flash); never the fused kernels (flash, memory-efficient, cuDNN,
    SageAttention). Decided without touching CUDA: on a GPU `sdpa` is taken as fused. A memory
    estimate's term (`h3core.runtime.limits`)."""
    if attention == "math":
        return 2 * 4 * heads * tokens * tokens  # h3's reference: float32 scores and softmax
    if attention != "sdpa" or device == "cuda":
        return 0
    kernel = planned_sdpa_kernel(torch.device("cpu"), dtype, heads, head_dim)
    return 2 * dtype.itemsize * heads * tokens * tokens if kernel == "sdpa:math" else 0


def is_math_kernel(kernel: str) -> bool:
    """True for the unfused kernels: sdpa's math fallback and h3's own fp32 reference."""
    return kernel in ("sdpa:math", KERNEL_NAMES["math"])
