"""Attention backends behind one function.

Layout everywhere in h3 is sequence-first without a batch dimension: `q, k, v: [S, H, Dh]`,
full bidirectional attention over the packed sequence (no mask: segments are packed with no
padding, so there is nothing to mask). Backends:

- `sdpa`  (default) `torch.nn.functional.scaled_dot_product_attention`; on CUDA PyTorch picks the
  flash or memory-efficient kernel.
- `math`  the reference: softmax(q k^T / sqrt(Dh)) v in float32, then cast back.
- `sage2` SageAttention 2 (package `sageattention`), CUDA only.
- `flash` FlashAttention (package `flash-attn`, module `flash_attn`), CUDA only.

Asking for a backend that is not installed or cannot run on the device is a `BackendUnavailable`
error that says what to install, never a silent fallback.
"""

from __future__ import annotations

import importlib
import math
from typing import Callable

import torch
import torch.nn.functional as F

from h3core.errors import BackendUnavailable

BACKENDS = ("sdpa", "math", "sage2", "flash")

_PACKAGES = {"sage2": ("sageattention", "sageattention"), "flash": ("flash_attn", "flash-attn")}


def _sdpa_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """What `_sdpa` hands to SDPA: [S, H, Dh] -> [H, S, Dh] views (SDPA's (..., L, E) convention).
    `kernel_name` asks the dispatcher about exactly these, so the kernel it names is the one that runs."""
    return q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    out = F.scaled_dot_product_attention(*_sdpa_inputs(q, k, v))
    return out.transpose(0, 1)


def _math(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    qf, kf, vf = (t.float().transpose(0, 1) for t in (q, k, v))  # [H, S, Dh]
    scores = qf @ kf.transpose(-1, -2) / math.sqrt(q.shape[-1])  # [H, S, S]
    return (scores.softmax(dim=-1) @ vf).transpose(0, 1).to(q.dtype)


def _sage2(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    from sageattention import sageattn

    # "NHD" = [batch, seq, heads, dim]
    return sageattn(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), tensor_layout="NHD", is_causal=False)[0]


def _flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    from flash_attn import flash_attn_func

    # [batch, seq, heads, dim]
    return flash_attn_func(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), causal=False)[0]


_IMPLS: dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "sdpa": _sdpa,
    "math": _math,
    "sage2": _sage2,
    "flash": _flash,
}


def check_backend(name: str, device_type: str) -> None:
    """Raise `BackendUnavailable` unless backend `name` can run on `device_type` ('cpu' or 'cuda')."""
    if name not in _IMPLS:
        raise BackendUnavailable(f"unknown attention backend {name!r}; choose one of: {', '.join(BACKENDS)}")
    if name not in _PACKAGES:
        return
    module, package = _PACKAGES[name]
    try:
        importlib.import_module(module)
    except Exception as err:  # ImportError, or a broken binary wheel raising OSError/RuntimeError
        raise BackendUnavailable(
            f"attention backend {name!r} needs the {package!r} package, which does not import here "
            f"({type(err).__name__}); `pip install {package}` on a CUDA machine, or use --attention sdpa"
        ) from None
    if device_type != "cuda":
        raise BackendUnavailable(f"attention backend {name!r} runs on CUDA only; use sdpa or math on {device_type}")


def kernel_name(backend: str, device: torch.device, dtype: torch.dtype, heads: int, head_dim: int) -> str:
    """Which kernel `backend` runs for this device, dtype and head shape, where it can be known.

    For `sdpa` this asks PyTorch's own dispatcher (`torch._fused_sdp_choice`, private, so a
    failure is reported as unknown rather than guessed) about inputs laid out exactly as `_sdpa`
    passes them (a 4-D probe would name a fused kernel that the real 3-D call does not get); the
    other backends are one kernel each.
    """
    if backend != "sdpa":
        return {"math": "h3 math (fp32 softmax)", "sage2": "SageAttention2", "flash": "flash-attn"}[backend]
    try:
        from torch.nn.attention import SDPBackend

        probe = torch.zeros(16, heads, head_dim, device=device, dtype=dtype)  # [S, H, Dh], as the model calls attend
        choice = int(torch._fused_sdp_choice(*_sdpa_inputs(probe, probe, probe)))
        names = {int(getattr(SDPBackend, n)): n.lower() for n in dir(SDPBackend) if n.isupper()}
        return f"sdpa:{names.get(choice, choice)}"
    except Exception as err:  # private API: absent or changed in this torch
        return f"sdpa:unknown ({type(err).__name__})"


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: str = "sdpa") -> torch.Tensor:
    """Full attention. q, k, v: [S, H, Dh] (same S for all three) -> [S, H, Dh]."""
    return _IMPLS[backend](q, k, v)
