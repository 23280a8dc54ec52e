"""What one rank's pipeline measures and asks with, passed in: `RankInstruments`.

A rank's load and denoise (`h3core.generate.pipeline`) touch the world outside their tensors in a
few places only, and each of them is an argument here, with the real one as its default:

| instrument | real (`RankInstruments.real`) | a dry run's (`h3core.generate.dryrun.fakes`) |
|---|---|---|
| `meter`: stopwatch and peak-memory window | the device's (`DeviceMeter`: CUDA events and allocator, or perf_counter and the RSS) | zero time; the live fake storage counted |
| `kernels`: what the device runs (capability, cuDNN, fp4 GEMM verdict, fused quantizer) | `DeviceKernels` of the rank's GPU, from the launcher's self-test record | the simulated GPU's |
| `host`: host arithmetic whose values decide shapes (positions, the sigma schedules, a step's clocks) | computed as is | computed on real host tensors, handed on as fake ones |
| `open_checkpoint`: the transformer file | `Checkpoint.open(run.checkpoint)` | its header only, every read a fake tensor |

The process group is the rank's context's (`RankContext.group`: a real group, or a dry run's fake
one), and the caches a rank's code keeps belong to the objects that live as long as it: the
collectives' scratch buffer to the runtime, SDPA decisions to each attention kernel, the fp4
verdict to `kernels`. A step's progress reaches the caller through `RankPipeline.denoise`'s `report`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol, TypeVar

import torch

from h3core.generate.request import ResolvedRun
from h3core.model.checkpoint import Checkpoint
from h3core.nvfp4.kernels import DeviceKernels
from h3core.runtime.device import DeviceMeter

T = TypeVar("T")


class HostValues(Protocol):
    """Computes host arithmetic whose values decide shapes: `host(fn, *args)` is `fn(*args)`, done
    where the values are real (a dry run's tensors have none)."""

    def __call__(self, fn: Callable[..., T], *args: object) -> T: ...


def on_host(fn: Callable[..., T], *args: object) -> T:
    """The real `HostValues`: `fn(*args)`, as it is."""
    return fn(*args)


def open_checkpoint(run: ResolvedRun) -> Checkpoint:
    """The real checkpoint opener: `run`'s transformer file, read as the run reads it."""
    return Checkpoint.open(run.checkpoint, run.config)


@dataclass
class RankInstruments:
    """A rank pipeline's instruments (module docstring)."""

    meter: DeviceMeter
    kernels: DeviceKernels
    host: HostValues = field(default=on_host)
    open_checkpoint: Callable[[ResolvedRun], Checkpoint] = field(default=open_checkpoint)

    @classmethod
    def real(cls, device: torch.device, run: ResolvedRun) -> "RankInstruments":
        """The real ones for a rank computing `run` on `device`: its GPU's kernels decided by the
        launcher's fp4 self-test of that GPU (`h3core.generate.fp4gate.rank_kernels`)."""
        from h3core.generate.fp4gate import rank_kernels

        return cls(meter=DeviceMeter(device), kernels=rank_kernels(run, device))
