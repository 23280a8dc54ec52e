"""Attention backends behind one function, and a record of the kernels that really ran.

Layout everywhere in h3 is sequence-first without a batch dimension: `q, k, v: [S, H, Dh]`,
full bidirectional attention over the packed sequence (no mask: segments are packed with no
padding, so there is nothing to mask). Backends:

- `sdpa`  (default) `torch.nn.functional.scaled_dot_product_attention` on 4-D `[1, H, S, Dh]`
  views of the inputs (no copy). PyTorch's fused kernels (flash, memory-efficient and cuDNN on
  CUDA; flash on the CPU) take 4-D input only: 3-D input silently runs the math kernel, which on
  CUDA upcasts to fp32 and materialises `[H, S, S]` scores (49 GB per copy at 56 x 14,855).
- `math`  the reference: softmax(q k^T / sqrt(Dh)) v in float32, then cast back.
- `sage2` SageAttention 2 (`sageattn`, built from github.com/thu-ml/SageAttention), CUDA only.
- `flash` FlashAttention 2 (package `flash-attn`, function `flash_attn.flash_attn_func`), CUDA only.

`check_backend` refuses, before any rank starts, a backend that is not installed, is the wrong
version, or cannot run this device, head width or dtype: one `BackendUnavailable` line that says
what to install or use instead, never a silent fallback.

What ran: every `attend` call adds one to its kernel's count in the record it is given (each rank's
`RankRecord`, on its runtime: `h3core.parallel.runtime`). For `sdpa` the kernel is PyTorch's own
dispatch decision (`torch._fused_sdp_choice`) on the very tensors of the call, decided once per
call signature (shapes, strides, dtype, device and the enabled-backend flags) and cached; a
report built from the record names the kernels the run used, not those of a probe.

Which fused kernels `sdpa` may take on CUDA is h3's rule, not PyTorch's default order
(`choose_sdpa_backends`, a pure function of torch version, cuDNN version, compute capability,
dtype, head width and sequence length); every CUDA call runs under `sdpa_kernel(<allowed>,
set_priority=True)`, so the dispatcher picks among those only, in that order, and never the math
kernel. Why cuDNN is restricted (sources in `CUDNN_SEQ_FIX_VERSION`): cuDNN attention before
9.15.1 has a memory error at sequence lengths that are not multiples of 128 (pytorch issue
169849), which is every H3 length; torch 2.9 put cuDNN first on sm_90/sm_100 for any cuDNN >= 9.9
(pytorch PR 162073), and only the releases carrying PR 171627 (cherry-picked as 171895) prefer it
from cuDNN 9.15.1 on.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import math
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from h3core.errors import BackendUnavailable

BACKENDS = ("sdpa", "math", "sage2", "flash")

SAGE2_ARCHS = ((8, 0), (8, 6), (8, 9), (9, 0), (12, 0))
"""Compute capabilities `sageattention.sageattn` (SageAttention 2.x) dispatches; it raises on others (e.g. sm_100)."""

SAGE2_MAX_HEAD_DIM = 128
"""SageAttention 2 pads head widths up to 64 or 128 and refuses wider heads."""

FLASH_MIN_CAPABILITY = (8, 0)
"""FlashAttention 2 runs on Ampere and later."""

FLASH_MAX_HEAD_DIM = 256

HALF_DTYPES = (torch.float16, torch.bfloat16)
"""The only dtypes the `sage2` and `flash` kernels take."""


def _sdpa_views(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """What `_sdpa` hands to SDPA: [S, H, Dh] -> [1, H, S, Dh] views, no copy."""
    return tuple(t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, record: Counter[str] | None) -> torch.Tensor:
    q4, k4, v4 = _sdpa_views(q, k, v)
    choice = _backend_choice(q4)
    if choice is None:  # the CPU: flash is its only fused kernel and PyTorch's order already takes it
        _count(record, sdpa_kernel_of(q4, k4, v4))
        return F.scaled_dot_product_attention(q4, k4, v4)[0].transpose(0, 1)  # [S, H, Dh]
    with sdpa_kernel(choice.sdp_backends, set_priority=True):  # the record and the call see the same rule
        _count(record, sdpa_kernel_of(q4, k4, v4))
        return F.scaled_dot_product_attention(q4, k4, v4)[0].transpose(0, 1)  # [S, H, Dh]


def _math(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, record: Counter[str] | None) -> torch.Tensor:
    qf, kf, vf = (t.float().transpose(0, 1) for t in (q, k, v))  # [H, S, Dh]
    scores = qf @ kf.transpose(-1, -2) / math.sqrt(q.shape[-1])  # [H, S, S]
    _count(record, KERNEL_NAMES["math"])
    return (scores.softmax(dim=-1) @ vf).transpose(0, 1).to(q.dtype)


def _sage2(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, record: Counter[str] | None) -> torch.Tensor:
    from sageattention import sageattn

    _count(record, KERNEL_NAMES["sage2"])
    # "NHD" = [batch, seq, heads, dim]
    return sageattn(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), tensor_layout="NHD", is_causal=False)[0]


def _flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, record: Counter[str] | None) -> torch.Tensor:
    from flash_attn import flash_attn_func

    _count(record, KERNEL_NAMES["flash"])
    # [batch, seq, heads, dim]
    return flash_attn_func(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), causal=False)[0]


_IMPLS: dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Counter[str] | None], torch.Tensor]] = {
    "sdpa": _sdpa,
    "math": _math,
    "sage2": _sage2,
    "flash": _flash,
}

KERNEL_NAMES = {"math": "h3 math (fp32 softmax)", "sage2": "SageAttention2", "flash": "flash-attn"}
"""The kernel each non-sdpa backend runs (one each)."""


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: str = "sdpa", record: Counter[str] | None = None) -> torch.Tensor:
    """Full attention. q, k, v: [S, H, Dh] (same S for all three) -> [S, H, Dh]. `record`: the
    rank's kernel record (`h3core.parallel.runtime.RankRecord.attention`), one count per call."""
    return _IMPLS[backend](q, k, v, record)


# --- what ran --------------------------------------------------------------------------------------

_sdpa_choices: dict[tuple, str] = {}
"""The dispatcher's decision per call signature (a cache of a pure function, not a record)."""


def _count(record: Counter[str] | None, kernel: str) -> None:
    if record is not None:
        record[kernel] += 1


def sdpa_kernel_of(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str:
    """`sdpa:<kernel>` that `scaled_dot_product_attention(q, k, v)` dispatches to for these tensors.

    Asks PyTorch's dispatcher (`torch._fused_sdp_choice`, private: a failure is reported as
    unknown, never guessed) once per call signature; the enabled-backend flags are part of the
    signature, so `torch.nn.attention.sdpa_kernel` contexts are honoured.
    """
    key = (*(_signature(t) for t in (q, k, v)), _enabled_sdp_flags())
    if key not in _sdpa_choices:
        _sdpa_choices[key] = _dispatch_choice(q, k, v)
    return _sdpa_choices[key]


def _signature(t: torch.Tensor) -> tuple:
    return (tuple(t.shape), t.stride(), t.dtype, t.device, t.storage_offset() % 16)


def _enabled_sdp_flags() -> tuple[bool, ...]:
    cuda = torch.backends.cuda
    return (cuda.flash_sdp_enabled(), cuda.mem_efficient_sdp_enabled(), cuda.math_sdp_enabled(), cuda.cudnn_sdp_enabled())


def _dispatch_choice(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str:
    try:
        from torch.nn.attention import SDPBackend

        choice = int(torch._fused_sdp_choice(q, k, v))
        names = {int(getattr(SDPBackend, n)): n.lower() for n in dir(SDPBackend) if n.isupper()}
        return f"sdpa:{names.get(choice, choice)}"
    except Exception as err:  # private API: absent or changed in this torch
        return f"sdpa:unknown ({type(err).__name__})"


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


# --- which fused kernels sdpa may take on CUDA (h3's rule) --------------------------------------------

CUDNN_SEQ_FIX_VERSION = 91501
"""The first cuDNN whose attention is known good at sequence lengths that are not multiples of 128:
9.15.1 (`cudnnGetVersion()` encoding). Sources: pytorch issue 169849 (memory errors at such lengths,
found with compute-sanitizer at S = 261); PyTorch's own guard `check_prefer_cudnn_attention`
("cuDNN 9.15.1 required for seq_len not divisible by 128 fix", `cudnn_version > 91500`, from PR
171627 and its cherry-pick PR 171895, which superseded PR 167101's `seqlen_q % 128 != 0 &&
cudnn_version <= 91500` bail-out); cudnn-frontend 1.16.0's notes (an invalid memory access at
`s_kv % 128 != 0` without a padding mask, fixed in cuDNN 9.15.1)."""

CUDNN_CAPABILITIES = ((9, 0), (10, 0), (10, 3))
"""Where h3 lets cuDNN attention run at all: datacenter Hopper and Blackwell, the architectures
PyTorch tests cuDNN attention on and prefers it on (PR 170800, `check_prefer_cudnn_attention`).
On the others (sm_80, sm_89, sm_120 ...) flash and efficient attention serve."""

CUDNN_MAX_HEAD_DIM = 128
"""cuDNN attention's head-width limit on every cuDNN h3 admits (256 needs cuDNN > 9.22 and frontend 1.24)."""

FLASH_SDPA_CAPABILITIES = ((8, 0), (12, 1))
"""PyTorch's flash kernel runs on sm_80 .. sm_121 (`check_flash_attention_hardware_support`)."""

EFFICIENT_SDPA_CAPABILITIES = ((5, 0), (12, 1))
"""PyTorch's memory-efficient kernel runs on sm_50 .. sm_121 (`check_mem_efficient_hardware_support`)."""

SDPA_FLASH_MAX_HEAD_DIM = 256


@dataclass(frozen=True)
class SdpaChoice:
    """The fused SDPA kernels a CUDA call may take, in the order PyTorch tries them, and why."""

    backends: tuple[str, ...]
    """`SDPBackend` names, lowercased as the kernel record writes them (`cudnn_attention`, ...)."""

    reason: str
    """One line: what was allowed and what was refused, with the refusal's cause."""

    torch_default_prefers_cudnn: bool
    """PyTorch's own order on this torch / cuDNN / GPU would put cuDNN first (where `backends`
    leaves cuDNN out, h3 overrides that default)."""

    @property
    def kernels(self) -> tuple[str, ...]:
        """The names the kernel record uses for these backends (`sdpa:flash_attention`, ...)."""
        return tuple(f"sdpa:{name}" for name in self.backends)

    @property
    def sdp_backends(self) -> list[SDPBackend]:
        return [getattr(SDPBackend, name.upper()) for name in self.backends]


def choose_sdpa_backends(
    *,
    torch_version: str,
    cudnn_version: int | None,
    capability: tuple[int, int],
    dtype: torch.dtype,
    head_dim: int,
    seq_len: int,
) -> SdpaChoice:
    """The fused kernels `attend(..., "sdpa")` may take on a CUDA device: a pure function, never math.

    cuDNN first where it is allowed (PyTorch's own order on the GPUs it is tested on), then flash,
    then memory-efficient. cuDNN only on `CUDNN_CAPABILITIES`, in fp16/bf16, at head widths up to
    128 (multiples of 8), and at lengths that are not multiples of 128 only from
    `CUDNN_SEQ_FIX_VERSION` on; an unknown cuDNN version is refused. An empty `backends` means no
    fused kernel fits (the caller refuses the run; see `check_backend`).
    """
    capability = (int(capability[0]), int(capability[1]))
    half = dtype in HALF_DTYPES
    problems = {
        "cudnn_attention": _cudnn_problem(cudnn_version, capability, half, head_dim, seq_len),
        "flash_attention": _flash_problem(capability, half, head_dim),
        "efficient_attention": _efficient_problem(capability, half, head_dim),
    }
    allowed = tuple(name for name, problem in problems.items() if problem is None)
    refused = [f"{name.removesuffix('_attention')} refused ({problem})" for name, problem in problems.items() if problem]
    where = f"sm_{capability[0]}{capability[1]}, {str(dtype).removeprefix('torch.')}, head_dim {head_dim}, S {seq_len}"
    reason = f"{where}: " + (f"allowed {', '.join(allowed)}" if allowed else "no fused SDPA kernel fits") + "".join(f"; {r}" for r in refused)
    return SdpaChoice(allowed, reason, torch_default_prefers_cudnn(torch_version, cudnn_version, capability))


def _cudnn_problem(cudnn_version: int | None, capability: tuple[int, int], half: bool, head_dim: int, seq_len: int) -> str | None:
    if cudnn_version is None:
        return "cuDNN version unknown"
    if capability not in CUDNN_CAPABILITIES:
        return f"not enabled on sm_{capability[0]}{capability[1]}"
    if not half:
        return "fp16/bf16 only"
    if head_dim > CUDNN_MAX_HEAD_DIM or head_dim % 8:
        return f"head_dim {head_dim} is not a multiple of 8 up to {CUDNN_MAX_HEAD_DIM}"
    if seq_len % 128 and cudnn_version < CUDNN_SEQ_FIX_VERSION:
        return f"cuDNN {_cudnn_name(cudnn_version)} < 9.15.1 at S % 128 != 0 (pytorch issue 169849)"
    return None


def _flash_problem(capability: tuple[int, int], half: bool, head_dim: int) -> str | None:
    low, high = FLASH_SDPA_CAPABILITIES
    if not low <= capability <= high:
        return f"runs on sm_{low[0]}{low[1]}..sm_{high[0]}{high[1]}"
    if not half:
        return "fp16/bf16 only"
    if head_dim > SDPA_FLASH_MAX_HEAD_DIM or head_dim % 8:
        return f"head_dim {head_dim} is not a multiple of 8 up to {SDPA_FLASH_MAX_HEAD_DIM}"
    return None


def _efficient_problem(capability: tuple[int, int], half: bool, head_dim: int) -> str | None:
    low, high = EFFICIENT_SDPA_CAPABILITIES
    if not low <= capability <= high:
        return f"runs on sm_{low[0]}{low[1]}..sm_{high[0]}{high[1]}"
    alignment = 8 if half else 4  # PyTorch's minimum GEMM alignment on sm_80 and later
    if head_dim % alignment:
        return f"head_dim {head_dim} is not a multiple of {alignment}"
    return None


def torch_default_prefers_cudnn(torch_version: str, cudnn_version: int | None, capability: tuple[int, int]) -> bool:
    """Whether PyTorch's own SDPA order puts cuDNN first here. torch 2.9: on sm_90 and sm_100 with
    cuDNN >= 9.9 (PR 162073; the 2.9.0 wheels' compile-time check may have turned it off, pytorch
    issue 165801, which Python cannot see, so the worse case is assumed); torch 2.10 on (PR 171627,
    cherry-picked as 171895): cuDNN > 9.15.0 on sm_90, sm_93, sm_100, sm_103; earlier torch: never."""
    version = _release(torch_version)
    if cudnn_version is None or version < (2, 9):
        return False
    if version < (2, 10):
        return cudnn_version >= 90900 and tuple(capability) in ((9, 0), (10, 0))
    return cudnn_version > 91500 and capability[0] in (9, 10) and capability[1] in (0, 3)


def _release(torch_version: str) -> tuple[int, int]:
    """(major, minor) of a torch version string such as '2.9.1+cu128' or '2.11.0.dev20260101'."""
    parts = torch_version.split("+")[0].split(".")
    return int(parts[0]), int("".join(ch for ch in parts[1] if ch.isdigit()) or 0)


def _cudnn_name(version: int) -> str:
    return f"{version // 10000}.{version // 100 % 100}.{version % 100}"


_choices: dict[tuple, SdpaChoice] = {}


def _backend_choice(q4: torch.Tensor) -> SdpaChoice | None:
    """The rule for a CUDA call with q4 [1, H, S, Dh] (decided once per device, dtype, width and
    length); None off CUDA. A call where no fused kernel fits is refused, never run as math."""
    if q4.device.type != "cuda":
        return None
    key = (q4.device, q4.dtype, q4.shape[-1], q4.shape[-2])
    if key not in _choices:
        _choices[key] = sdpa_choice_here(q4.dtype, q4.shape[-1], q4.shape[-2], q4.device)
    choice = _choices[key]
    if not choice.backends:
        raise BackendUnavailable(f"attention backend 'sdpa' has no fused kernel here ({choice.reason}); use --dtype bf16 or another --attention")
    return choice


def sdpa_choice_here(dtype: torch.dtype, head_dim: int, seq_len: int, device: torch.device | str = "cuda") -> SdpaChoice:
    """`choose_sdpa_backends` with this process's torch, cuDNN and the GPU `device`."""
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return choose_sdpa_backends(
        torch_version=torch.__version__,
        cudnn_version=cudnn,
        capability=torch.cuda.get_device_capability(device),
        dtype=dtype,
        head_dim=head_dim,
        seq_len=seq_len,
    )


def sdpa_rule_for_report(report_path: str | Path) -> str:
    """JSON of the rule on this GPU for the run an `h3 generate --json` report describes (its dtype,
    head width and packed length): what `scripts/gpu_check.sh` checks each rank's kernels against."""
    from h3core.files.text import read_json

    report = read_json(report_path, "the report", 64 << 20, "give the report of an h3 generate --json run", want=dict)
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    choice = sdpa_choice_here(dtypes[report["dtype"]], report["config"]["head_dim"], report["num_tokens"])
    return json.dumps({"allowed": list(choice.kernels), "reason": choice.reason, "torch_default_prefers_cudnn": choice.torch_default_prefers_cudnn})


# --- can a backend run here? -------------------------------------------------------------------------


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
    if name not in _IMPLS:
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


def _import_or_refuse(name: str, module: str, fix: str):  # type: ignore[no-untyped-def]
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
