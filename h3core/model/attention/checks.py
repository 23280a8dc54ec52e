"""The pre-run checks of the attention backends: can backend `name` run on this device, at this head
width and compute dtype (`check_backend`)? Called before any rank starts.

A backend that is not installed, is the wrong version, or cannot run this device, head width or
dtype is refused in one `BackendUnavailable` line that says what to install or use instead, never a
silent fallback. `sdpa` on CUDA is refused where h3's rule (`h3core.model.attention.sdpa_rule`)
leaves no fused kernel (math is never taken on a GPU).
"""

from __future__ import annotations

import importlib
import importlib.metadata
from types import ModuleType

import torch

from h3core.errors import BackendUnavailable
from h3core.model.attention.dispatch import BACKENDS
from h3core.model.attention.sdpa_rule import HALF_DTYPES, choose_sdpa_backends

SAGE2_ARCHS = ((8, 0), (8, 6), (8, 9), (9, 0), (12, 0))
"""Compute capabilities `sageattention.sageattn` (SageAttention 2.x) dispatches; it raises on others (e.g. sm_100)."""

SAGE2_MAX_HEAD_DIM = 128
"""SageAttention 2 pads head widths up to 64 or 128 and refuses wider heads."""

FLASH_MIN_CAPABILITY = (8, 0)
"""FlashAttention 2 runs on Ampere and later."""

FLASH_MAX_HEAD_DIM = 256


def check_backend(
    name: str,
    device_type: str,
    *,
    head_dim: int | None = None,
    dtype: torch.dtype | None = None,
    capability: tuple[int, int] | None = None,
) -> None:
    """Raise `BackendUnavailable` unless backend `name` can run on `device_type` ('cpu' or 'cuda')
    at this head width and compute dtype. `capability`: the GPU's compute capability (default:
    that of cuda:0, read without starting CUDA work). Called before any rank starts."""
    if name not in BACKENDS:
        raise BackendUnavailable(f"unknown attention backend {name!r}; choose one of: {', '.join(BACKENDS)}")
    if name == "sdpa":
        _check_sdpa(device_type, head_dim, dtype, capability)
        return
    if name == "math":
        return
    if name == "sage2":
        _check_sage2(device_type, head_dim, dtype, capability)
    else:
        _check_flash(device_type, head_dim, dtype, capability)


def _check_sdpa(device_type: str, head_dim: int | None, dtype: torch.dtype | None, capability: tuple[int, int] | None) -> None:
    """On CUDA, refuse before any rank starts a run where h3's rule leaves no fused kernel (math
    is never taken on a GPU). cuDNN plays no part here: flash or efficient fit wherever it does."""
    arch = capability or (_gpu_capability() if device_type == "cuda" else None)
    if device_type != "cuda" or arch is None or head_dim is None or dtype is None:
        return
    choice = choose_sdpa_backends(torch_version=torch.__version__, cudnn_version=None, capability=arch, dtype=dtype, head_dim=head_dim, seq_len=128)
    if not choice.backends:
        raise BackendUnavailable(f"attention backend 'sdpa' has no fused kernel here ({choice.reason}); use --dtype bf16 or another --attention")


def _check_sage2(device_type: str, head_dim: int | None, dtype: torch.dtype | None, capability: tuple[int, int] | None) -> None:
    fix = "install SageAttention 2 from source (github.com/thu-ml/SageAttention; the PyPI wheel is version 1), or use --attention sdpa"
    module = _import_or_refuse("sage2", "sageattention", fix)
    version = _installed_version("sageattention")
    if version is None or not version.split(".")[0].isdigit() or int(version.split(".")[0]) < 2:
        raise BackendUnavailable(f"attention backend 'sage2' needs SageAttention 2, but sageattention {version or '(unknown version)'} is installed; {fix}")
    if not hasattr(module, "sageattn"):
        raise BackendUnavailable(f"sageattention {version} has no `sageattn` function; {fix}")
    _check_cuda("sage2", device_type)
    arch = capability or _gpu_capability()
    if arch is not None and tuple(arch) not in SAGE2_ARCHS:
        supported = ", ".join(f"sm_{a}{b}" for a, b in SAGE2_ARCHS)
        raise BackendUnavailable(f"SageAttention 2 does not run on this GPU (sm_{arch[0]}{arch[1]}; it supports {supported}); use --attention sdpa")
    if head_dim is not None and head_dim > SAGE2_MAX_HEAD_DIM:
        raise BackendUnavailable(f"SageAttention 2 takes head widths up to {SAGE2_MAX_HEAD_DIM}, this model has {head_dim}; use --attention sdpa")
    _check_half("sage2", dtype)


def _check_flash(device_type: str, head_dim: int | None, dtype: torch.dtype | None, capability: tuple[int, int] | None) -> None:
    fix = "`pip install flash-attn` (FlashAttention 2) on a CUDA machine, or use --attention sdpa"
    module = _import_or_refuse("flash", "flash_attn", fix)
    if not hasattr(module, "flash_attn_func"):
        version = _installed_version("flash-attn") or _installed_version("flash_attn") or "this version"
        raise BackendUnavailable(f"flash_attn ({version}) has no `flash_attn_func` (FlashAttention 4 installs differ); {fix}")
    _check_cuda("flash", device_type)
    arch = capability or _gpu_capability()
    if arch is not None and tuple(arch) < FLASH_MIN_CAPABILITY:
        raise BackendUnavailable(f"FlashAttention 2 needs compute capability 8.0 or newer, this GPU has {arch[0]}.{arch[1]}; use --attention sdpa")
    if head_dim is not None and (head_dim % 8 or head_dim > FLASH_MAX_HEAD_DIM):
        raise BackendUnavailable(f"FlashAttention takes head widths that are multiples of 8 up to {FLASH_MAX_HEAD_DIM}, this model has {head_dim}; use --attention sdpa")
    _check_half("flash", dtype)


def _import_or_refuse(name: str, module: str, fix: str) -> ModuleType:
    try:
        return importlib.import_module(module)
    except Exception as err:  # ImportError, or a broken binary wheel raising OSError/RuntimeError
        raise BackendUnavailable(f"attention backend {name!r} needs the {module!r} module, which does not import here ({type(err).__name__}); {fix}") from None


def _installed_version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _check_cuda(name: str, device_type: str) -> None:
    if device_type != "cuda":
        raise BackendUnavailable(f"attention backend {name!r} runs on CUDA only; use sdpa or math on {device_type}")


def _check_half(name: str, dtype: torch.dtype | None) -> None:
    if dtype is not None and dtype not in HALF_DTYPES:
        raise BackendUnavailable(f"attention backend {name!r} computes in fp16 or bf16 only, not {str(dtype).removeprefix('torch.')}; drop --dtype fp32 or use --attention sdpa")


def _gpu_capability() -> tuple[int, int] | None:
    return torch.cuda.get_device_capability(0) if torch.cuda.is_available() else None
