"""What a device can run, as the code computing on it asks: `DeviceKernels`.

An NVFP4 linear's path (`h3core.nvfp4.matmul.choose_path`) and h3's SDPA rule
(`h3core.model.attention.sdpa_rule`) depend on facts about the device they compute on: its compute
capability, its cuDNN, whether h3's fused activation quantizer can launch there, and whether its
fp4 GEMM may run (the self-test's verdict, `h3core.nvfp4.selftest`); and NVFP4 decoding's lookup
tables on that device live with those facts (`DecodeTables`). Those modules ask a
`DeviceKernels` object for them, never `torch.cuda` directly, so that a dry run can hand them a GPU
it has not got (`h3core.generate.dryrun`): the object is the seam.

Who holds one: a rank's pipeline makes one for its device (from the launcher's self-test record of
its GPU, `h3core.generate.fp4gate.rank_kernels`) and gives it to the loader, which gives it to every
linear it builds, and to every attention kernel of its model; a linear or kernel built by hand
asks for its device's own the first time it needs it and keeps it. The fp4 verdict is decided
once per object, lazily (a self-test runs in a child process only if no record was given and an
fp4 GEMM is asked for).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch

from h3core.nvfp4.codec import DecodeTables

if TYPE_CHECKING:
    from h3core.nvfp4.selftest import FP4SelfTest


@dataclass
class DeviceKernels:
    """The facts of one device that decide which kernels h3 runs there (module docstring)."""

    device: torch.device
    capability: tuple[int, int] | None
    """Compute capability on CUDA; None elsewhere."""
    cudnn_version: int | None = None
    """`cudnnGetVersion()` where cuDNN is available (h3's SDPA rule reads it), else None."""
    fused_quantizer: bool = False
    """h3's fused NVFP4 activation quantizer can launch here (CUDA, triton importable)."""
    fp4_verdict: Callable[[], str | None] = field(default=lambda: None, repr=False)
    """None if the fp4 GEMM may run here, else why not (one line); asked at most once (`fp4_gemm_problem`)."""
    tables: DecodeTables = field(default_factory=DecodeTables, repr=False)
    """The NVFP4 decode's lookup tables on this device, made once for everything these facts serve."""
    _problem: tuple[str | None] | None = field(default=None, init=False, repr=False)

    def fp4_gemm_problem(self) -> str | None:
        """None if the fp4 GEMM may run on this device, else the one-line reason (decided once)."""
        if self._problem is None:
            self._problem = (_torch_fp4_problem() or self.fp4_verdict(),)
        return self._problem[0]

    def serves(self, device: torch.device) -> bool:
        """Whether these are the facts of `device` (a module moved to another device asks again)."""
        return self.device.type == device.type and (self.device.index or 0) == (device.index or 0)

    @classmethod
    def of(cls, device: torch.device | str, selftest: "FP4SelfTest | None" = None) -> "DeviceKernels":
        """This process's own answers for `device`: torch's capability and cuDNN, triton for the fused
        quantizer, and the fp4 GEMM's verdict: `selftest` (the launcher's record for this GPU) when
        given, else the self-test run in a child process the first time a verdict is asked."""
        device = torch.device(device)
        if device.type != "cuda":
            return cls(device, None)
        from h3core.nvfp4.activation import triton_available

        cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
        capability = tuple(torch.cuda.get_device_capability(device))
        return cls(device, (int(capability[0]), int(capability[1])), cudnn, triton_available(), _verdict(device, selftest))

    @classmethod
    def simulated(cls, device: torch.device, capability: tuple[int, int], cudnn_version: int | None = None) -> "DeviceKernels":
        """A GPU of `capability` whose fp4 GEMM passed its self-test and whose fused quantizer launches:
        what a dry run predicts for (`h3core.generate.dryrun`)."""
        return cls(device, capability, cudnn_version, fused_quantizer=True)


def _verdict(device: torch.device, record: "FP4SelfTest | None") -> Callable[[], str | None]:
    def verdict() -> str | None:
        from h3core.nvfp4.selftest import DEFAULT_SHAPES, run_fp4_selftest

        result = record if record is not None else run_fp4_selftest(DEFAULT_SHAPES, str(device))
        return None if result.accepted else result.reason

    return verdict


def _torch_fp4_problem() -> str | None:
    if not hasattr(torch, "float4_e2m1fn_x2") or not hasattr(torch, "_scaled_mm"):
        return f"torch {torch.__version__} has no float4_e2m1fn_x2 / _scaled_mm"
    return None
