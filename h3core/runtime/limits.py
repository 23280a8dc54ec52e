"""Limits before work: what a run needs per rank, against what the machine has, checked before any rank starts.

A command estimates its need per rank as a `MemoryNeed` (`h3 generate`: `h3core.generate.memory`
from the run's plan; `h3 bench-transport`: `h3core.bench.transport`). An estimate is a *lower
bound*: the sum of tensors a rank must hold at the same time, plus what a rank process costs
before it does anything (`PROCESS_BYTES`). A run whose lower bound does not fit cannot succeed, so
`check_memory` refuses it in one line before any rank starts and before any tensor is allocated (a
request for 100000x100000 pixels used to allocate for 15 s and die with "can't allocate memory"),
naming the largest part and what to change.

On a CPU every rank's need comes out of one pool (`MemAvailable`, or the cgroup's limit when
lower). On CUDA each rank's device part must fit its GPU (total memory less a CUDA context) and
the host parts of all ranks the host. `H3_MEMORY_CHECK=0` skips the check (an estimate can be
wrong about a machine with swap); `H3_MAX_CPU_RANKS` raises the cap on Gloo ranks per machine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from h3core import settings
from h3core.errors import ResourceLimit
from h3core.reports.units import format_bytes

PROCESS_BYTES = 128 << 20
"""A spawned rank's own process (Python, torch, Gloo): measured at ~147 MiB of anonymous memory on
Linux before any work; 128 MiB is counted."""
CUDA_CONTEXT_BYTES = 256 << 20  # lower bound of what the CUDA context and NCCL take from each GPU


@dataclass(frozen=True)
class MemoryNeed:
    """Bytes one rank needs (the largest rank), by part, split by where they live."""

    ranks: int
    device: str  # "cpu" | "cuda"
    on_device: dict[str, int] = field(default_factory=dict)  # on the rank's compute device
    on_host: dict[str, int] = field(default_factory=dict)  # in host memory whatever the device
    spawned: bool = True  # ranks are new processes (False: one rank in this process)

    def host_total(self) -> int:
        """Host bytes of all ranks together (on a CPU the device parts are host memory too)."""
        per_rank = sum(self.on_host.values()) + (sum(self.on_device.values()) if self.device == "cpu" else 0)
        return self.ranks * per_rank

    def parts(self) -> dict[str, int]:
        merged: dict[str, int] = {}
        for name, n in [*self.on_device.items(), *self.on_host.items()]:
            merged[name] = merged.get(name, 0) + n
        return dict(sorted(merged.items(), key=lambda item: -item[1]))

    def describe(self) -> str:
        return ", ".join(f"{name} {format_bytes(n)}" for name, n in self.parts().items() if n)


# --- estimates -------------------------------------------------------------------------------------


# --- what the machine has --------------------------------------------------------------------------


@dataclass(frozen=True)
class Capacity:
    """Memory a run may use: host bytes available now, and each GPU's usable bytes (CUDA)."""

    host_bytes: int | None  # None: unknown (no /proc): the host check is skipped
    host_source: str
    gpu_bytes: list[int] = field(default_factory=list)


def host_available() -> tuple[int | None, str]:
    """(bytes, where the figure comes from): `MemAvailable`, or the cgroup's remaining limit if lower."""
    available, source = None, ""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available, source = int(line.split()[1]) * 1024, "MemAvailable"
    except (OSError, ValueError):
        pass
    cgroup = _cgroup_remaining()
    if cgroup is not None and (available is None or cgroup < available):
        available, source = cgroup, "the cgroup's memory.max"
    return available, source


def _cgroup_remaining() -> int | None:
    root = Path("/sys/fs/cgroup")
    try:
        limit = (root / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return max(0, int(limit) - int((root / "memory.current").read_text().strip()))
    except (OSError, ValueError):
        return None


def capacity(device: str, ranks: int) -> Capacity:
    """What this machine offers a run of `ranks` ranks on `device` (no CUDA context is created)."""
    host, source = host_available()
    gpus: list[int] = []
    if device == "cuda":
        import torch

        gpus = [torch.cuda.get_device_properties(i).total_memory - CUDA_CONTEXT_BYTES for i in range(min(ranks, torch.cuda.device_count()))]
    return Capacity(host_bytes=host, host_source=source, gpu_bytes=gpus)


# --- the checks ------------------------------------------------------------------------------------


def check_memory(need: MemoryNeed, have: Capacity, what: str, *, host_part: bool = True, device_part: bool = True) -> None:
    """Raise `ResourceLimit` (one line, exit 2) when `need` cannot fit `have`; no-op when
    `H3_MEMORY_CHECK=0`. `what` names the run's knobs for the advice ('--width/--height/--frames');
    `host_part` / `device_part`: check the host's memory / each GPU's (both by default)."""
    if not settings.memory_check():
        return
    skip = f"{settings.MEMORY_CHECK}=0 skips this check"
    if device_part and need.device == "cuda" and have.gpu_bytes:
        per_gpu = sum(need.on_device.values())
        smallest = min(have.gpu_bytes)
        if per_gpu > smallest:
            raise ResourceLimit(
                f"this run needs at least {format_bytes(per_gpu)} of GPU memory per rank ({_device_parts(need)}) but a GPU here "
                f"has {format_bytes(smallest)} usable; {_advice(need, what)}; {skip}"
            )
    host = need.host_total()
    if host_part and have.host_bytes is not None and host > have.host_bytes:
        ranks = f" ({need.ranks} ranks x {format_bytes(host // need.ranks)})" if need.ranks > 1 else ""
        raise ResourceLimit(
            f"this run needs at least {format_bytes(host)} of memory{ranks}: {need.describe()} per rank; "
            f"this machine has {format_bytes(have.host_bytes)} available ({have.host_source}); {_advice(need, what)}; {skip}"
        )


def _device_parts(need: MemoryNeed) -> str:
    return ", ".join(f"{name} {format_bytes(n)}" for name, n in sorted(need.on_device.items(), key=lambda item: -item[1]) if n)


def _advice(need: MemoryNeed, what: str) -> str:
    largest = next(iter(need.parts()))
    if largest == "steps":
        return "use fewer --steps"
    if largest == "process":
        return "use fewer ranks"
    if largest == "weights":
        return "use tensor mode or more GPUs, so that each holds a share of the weights"
    return f"use a smaller {what}" + (" or more ranks" if need.device == "cuda" else "")


def check_cpu_ranks(world_size: int) -> None:
    """A CPU run is `world_size` processes on one machine; more than `H3_MAX_CPU_RANKS` (64) is refused."""
    cap = settings.max_cpu_ranks()
    if world_size > cap:
        raise ResourceLimit(
            f"{world_size} CPU ranks asked for, but h3 starts at most {cap} Gloo ranks on one machine (each is a "
            f"process with its own torch, about {format_bytes(world_size * PROCESS_BYTES)} for {world_size} before any work); "
            f"use at most {cap}, or set {settings.MAX_CPU_RANKS}={world_size} to allow more"
        )
