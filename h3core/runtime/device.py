"""Device policy: which device and dtype a rank computes on, and what the machine has.

Everything that depends on "CPU or CUDA" is decided here and nowhere else:

- device: `auto` picks CUDA when this torch build sees a GPU, else the CPU; asking for `cuda`
  without one is a `BackendUnavailable` error (exit 2), never a silent fallback.
- dtype: bf16 on CUDA, fp32 on the CPU, unless the user asks for fp32, bf16 or fp16.
- ranks: rank `r` of a CUDA run computes on `cuda:{local_rank}`; a CUDA run cannot have more ranks
  than visible GPUs (ConfigError); a CPU run can have up to `H3_MAX_CPU_RANKS` (64; Gloo ranks
  share the cores; see `h3core.runtime.limits`).
- timing: `Stopwatch` uses CUDA events on CUDA and `perf_counter` on the CPU, and returns only
  after the device has finished the timed work.
- memory: `peak_memory_bytes` is `torch.cuda.max_memory_allocated` on CUDA (tensor bytes the
  caching allocator handed out, the seed's figure), and on the CPU the peak resident set size of
  the whole process (Linux `VmHWM`), which also counts Python, torch's code and allocator slack.
  `reset_peak_memory` resets both (the CPU one through `/proc/self/clear_refs`, after handing the
  memory h3's CPU allocator policy retains back to the kernel: see `h3core.runtime.cpu_memory`).
  `release_memory` returns what a finished in-process run held: garbage collection, then on CUDA
  the caching allocator's cached blocks and cuBLAS's workspaces. `DeviceMeter` is the stopwatch
  and the peak window of one device as one object, what a rank's pipeline measures with (so that a
  dry run can hand it another).
- NCCL: `nccl_environment` sets fail-fast defaults so that a dead rank does not hang the others.

torch is imported lazily so that commands which only plan (`h3 plan`) start fast.
"""

from __future__ import annotations

import os
import resource
import time
from contextlib import contextmanager
from typing import TYPE_CHECKING, Iterator

from h3core import settings
from h3core.errors import BackendUnavailable, ConfigError

if TYPE_CHECKING:
    import torch

DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("fp32", "bf16", "fp16")
DTYPE_NAMES = {"fp32": "fp32", "float32": "fp32", "float": "fp32", "bf16": "bf16", "bfloat16": "bf16",
               "fp16": "fp16", "float16": "fp16", "half": "fp16"}
"""Every spelling of a compute dtype h3 takes: its own (`DTYPES`) and torch's (`torch.float32` less the prefix)."""
DTYPE_CHOICES = "fp32 (float32), bf16 (bfloat16) or fp16 (float16)"


def dtype_key(name: str) -> str:
    """h3's name of the dtype `name` spells (`float32` -> `fp32`; case and spaces aside); ValueError for any other."""
    key = DTYPE_NAMES.get(name.strip().lower().removeprefix("torch."))
    if key is None:
        raise ValueError(f"is not a dtype h3 computes in; choose {DTYPE_CHOICES}")
    return key


def visible_gpu_count() -> int:
    """CUDA devices this process can see (0 without CUDA); imports torch lazily."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_device(name: str) -> str:
    """'auto' | 'cpu' | 'cuda' -> 'cpu' | 'cuda' (the device type every rank of a run uses)."""
    choice = name.strip().lower()
    if choice not in DEVICES:
        raise ConfigError(f"unknown device {name!r}; choose one of: {', '.join(DEVICES)}")
    if choice == "cpu":
        return "cpu"
    gpus = visible_gpu_count()
    if choice == "auto":
        return "cuda" if gpus else "cpu"
    if not gpus:
        raise BackendUnavailable(f"--device cuda asked for, but {_why_no_cuda()}; use --device cpu or auto")
    return "cuda"


def _why_no_cuda() -> str:
    import torch

    if torch.version.cuda is None:
        return f"this torch build ({torch.__version__}) has no CUDA support"
    hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
    if hidden is not None:
        return f"torch {torch.__version__} sees no CUDA device (CUDA_VISIBLE_DEVICES={hidden!r})"
    return f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA device or driver"


def compute_dtype(device_type: str, override: str | None = None) -> "torch.dtype":
    """The dtype a run computes in: `override` when given, else bf16 on CUDA and fp32 on the CPU."""
    import torch

    by_name = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    if override is None:
        return torch.bfloat16 if device_type == "cuda" else torch.float32
    try:
        return by_name[dtype_key(override)]
    except ValueError as err:
        raise ConfigError(f"--dtype {override!r}: {err}") from None


def dtype_name(dtype: "torch.dtype") -> str:
    """torch.bfloat16 -> 'bf16' (the spelling flags and reports use)."""
    return str(dtype).removeprefix("torch.").replace("bfloat", "bf").replace("float", "fp")


def device_name(device_type: str) -> str:
    """What the ranks run on, for reports: the GPU's name, or the CPU model and core count."""
    import os
    import platform

    import torch

    if device_type == "cuda":
        return torch.cuda.get_device_name(0)
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    return f"CPU {model or platform.processor() or platform.machine()} ({os.cpu_count()} cores)"


def check_world_size_fits(world_size: int, device_type: str) -> None:
    """A CUDA run needs one visible GPU per rank of this machine; a CPU run takes Gloo ranks up to
    `H3_MAX_CPU_RANKS` per machine. Under torchrun the ranks of this machine are its
    `LOCAL_WORLD_SIZE` (a multi-node world is larger than any one machine)."""
    if world_size < 1:
        raise ConfigError(f"world size must be at least 1, got {world_size}")
    here = settings.ranks_on_this_machine(world_size)
    where = f" on this machine (LOCAL_WORLD_SIZE={here} of WORLD_SIZE={world_size})" if settings.under_torchrun() else ""
    if device_type != "cuda":
        from h3core.runtime.limits import check_cpu_ranks

        check_cpu_ranks(here)
        return
    gpus = visible_gpu_count()
    if here > gpus:
        raise ConfigError(
            f"{here} ranks asked for{where} but only {gpus} GPU(s) are visible; "
            f"use a count of at most {gpus} per machine, or --device cpu for Gloo ranks"
        )


def rank_device(device_type: str, local_rank: int) -> "torch.device":
    """The device rank `local_rank` of this machine computes on: `cuda:{local_rank}` or the CPU."""
    import torch

    return torch.device("cuda", local_rank) if device_type == "cuda" else torch.device("cpu")


def cpu_threads_per_rank(ranks_on_machine: int) -> int:
    """Intra-op threads per rank so that the ranks of one machine do not oversubscribe its cores."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, ranks_on_machine))


@contextmanager
def cpu_threads(threads: int) -> Iterator[None]:
    """Run a block with `threads` intra-op CPU threads, then restore the previous count.

    CPU GEMM and attention kernels choose their blocking by thread count, so two runs are bit
    comparable only at equal thread counts; parity references use the ranks' count.
    """
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def nccl_environment(timeout_s: float) -> dict[str, str]:
    """Fail-fast NCCL settings (set before the process group exists; the user's own values win).

    Async error handling tears a rank down when a collective fails or times out instead of
    letting it wait forever on a peer that is gone.
    """
    return {
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
        "TORCH_NCCL_BLOCKING_WAIT": "0",
        "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": str(max(60, int(timeout_s))),
    }


def synchronize(device: "torch.device | str") -> None:
    """Wait until `device` has finished all queued work (a no-op on the CPU)."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Stopwatch:
    """Times a region on a device; `seconds` is valid after the `with` block.

    CUDA: events recorded on the current stream around the region, then synchronised, so the
    figure is device time of the queued work. CPU: `perf_counter` around the region.
    """

    def __init__(self, device: "torch.device | str"):
        import torch

        self.device = torch.device(device)
        self.seconds = float("nan")
        self._started = 0.0
        self._events: tuple[torch.cuda.Event, torch.cuda.Event] | None = None

    def __enter__(self) -> "Stopwatch":
        import torch

        if self.device.type == "cuda":
            self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self._events[0].record()
        else:
            self._started = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._events is not None:
            start, end = self._events
            end.record()
            end.synchronize()
            self.seconds = start.elapsed_time(end) / 1000.0
        else:
            self.seconds = time.perf_counter() - self._started


class DeviceMeter:
    """What a rank's pipeline measures on its device: how long a region takes (`stopwatch`), and the
    peak memory of a window (`reset_peak`, `peak`; see the module docstring for what each device
    measures). A dry run passes one that counts its fake tensors instead (`h3core.generate.dryrun`)."""

    def __init__(self, device: "torch.device | str"):
        import torch

        self.device = torch.device(device)

    def stopwatch(self) -> Stopwatch:
        return Stopwatch(self.device)

    def reset_peak(self) -> None:
        reset_peak_memory(self.device)

    def peak(self) -> int:
        return peak_memory_bytes(self.device)

    def current(self) -> int:
        return current_memory_bytes(self.device)


def resident_bytes(module: "torch.nn.Module") -> int:
    """Bytes of every parameter and buffer a module holds, each tensor once, meta tensors excluded."""
    tensors = {id(t): t for t in (*module.parameters(), *module.buffers())}
    return sum(t.numel() * t.element_size() for t in tensors.values() if t.device.type != "meta")


def reset_peak_memory(device: "torch.device | str") -> None:
    """Start a new peak-memory window (see the module docstring for what each device measures)."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    from h3core.runtime import cpu_memory

    if cpu_memory.policy() == cpu_memory.RETAIN:
        cpu_memory.release()  # the window starts at the live memory, not at what the allocator kept
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # 5: reset the peak resident set size (VmHWM) to the current one
    except OSError:
        pass  # no procfs: the peak then covers the whole life of the process


def peak_memory_bytes(device: "torch.device | str") -> int:
    """Peak bytes since the last reset: CUDA allocator peak, or the process's peak resident set."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return _peak_rss_bytes()


def current_memory_bytes(device: "torch.device | str") -> int:
    """What `peak_memory_bytes` measures, now: CUDA allocated bytes, or the process's resident set."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.memory_allocated(device))
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024  # reported in kB
    except OSError:
        pass
    return 0


def peak_memory_kind(device_type: str) -> str:
    """What `peak_memory_bytes` measured, for reports."""
    if device_type == "cuda":
        return "torch.cuda.max_memory_allocated"
    return "process peak resident set size (VmHWM)"


def _peak_rss_bytes() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # reported in kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: kB


def release_memory(device_type: str) -> None:
    """After a run in this process: collect its garbage and, on CUDA, hand every cached block and
    cuBLAS workspace back to the driver, so that later runs (and other processes' ranks on the same
    GPU) find the memory free and their peaks are their own."""
    import gc

    import torch

    gc.collect()
    if device_type == "cuda" and torch.cuda.is_available():
        torch.cuda.synchronize()
        clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear_workspaces is not None:
            clear_workspaces()
        torch.cuda.empty_cache()
