"""h3's SDPA rule table: which fused kernels `sdpa` may take on a CUDA device, a pure function of the
torch version, the cuDNN version, the compute capability, the dtype, the head width and the sequence
length (`choose_sdpa_backends`), and the same for one device (`sdpa_choice_for`, `sdpa_choice_here`).

Every CUDA call of `h3core.model.attention.dispatch` runs under `sdpa_kernel(<allowed>,
set_priority=True)`, so PyTorch's dispatcher picks among those only, in that order, and never the
math kernel. Why cuDNN is restricted (sources in `CUDNN_SEQ_FIX_VERSION`): cuDNN attention before
9.15.1 has a memory error at sequence lengths that are not multiples of 128 (pytorch issue 169849),
which is every H3 length; torch 2.9 put cuDNN first on sm_90/sm_100 for any cuDNN >= 9.9 (pytorch PR
162073), and only the releases carrying PR 171627 (cherry-picked as 171895) prefer it from cuDNN
9.15.1 on. `scripts/gpu_check.sh` checks each rank's kernels against this rule
(`h3core.verify.gpu_reports.sdpa_rule_for_report`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn.attention import SDPBackend

from h3core.nvfp4.kernels import DeviceKernels

HALF_DTYPES = (torch.float16, torch.bfloat16)
"""The dtypes cuDNN's and flash's SDPA kernels, and the `sage2` and `flash` backends, take."""

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


def sdpa_choice_for(device: DeviceKernels, dtype: torch.dtype, head_dim: int, seq_len: int) -> SdpaChoice:
    """`choose_sdpa_backends` with this process's torch and the GPU `device` describes (its capability and cuDNN)."""
    assert device.capability is not None, f"the SDPA rule is for CUDA devices, not {device.device}"
    return choose_sdpa_backends(
        torch_version=torch.__version__,
        cudnn_version=device.cudnn_version,
        capability=device.capability,
        dtype=dtype,
        head_dim=head_dim,
        seq_len=seq_len,
    )


def sdpa_choice_here(dtype: torch.dtype, head_dim: int, seq_len: int, device: torch.device | str = "cuda") -> SdpaChoice:
    """`choose_sdpa_backends` with this process's torch, cuDNN and the GPU `device`."""
    return sdpa_choice_for(DeviceKernels.of(device), dtype, head_dim, seq_len)
