"""Fake CUDA for a dry run: h3's own rank code on fake tensors, its device memory counted, no GPU.

A dry run (`h3core.generate.dryrun`) executes the real load and denoising code of one rank at the
real shapes, but every tensor is a `FakeTensor` (`torch._subclasses.fake_tensor.FakeTensorMode`):
shapes, dtypes and devices are propagated through every operation, no data exists. This module is
what that needs from below the model:

- `cuda_guard_problem()`: fake *CUDA* tensors on a CPU-only torch build. FakeTensorMode creates
  fake CUDA tensors from factory functions by itself, but any operation that moves a tensor to
  CUDA (`.to("cuda")`, `copy_` across devices) opens a `DeviceGuard` for CUDA first, and a CPU
  build has no CUDA guard implementation ("PyTorch is not linked with support for cuda devices").
  The smallest cure: c10's own `NoOpDeviceGuardImpl<CUDA>` registered from a two-line C++ file,
  compiled once with the system's C++ compiler against torch's headers and libc10 (under a second)
  and cached under `H3_CACHE_DIR`; loading it registers the guard for the rest of the process.
  A torch built with CUDA has its guard already: nothing is compiled (and nothing must be: a second
  registration would replace the real one). No compiler: the reason, and dry runs are skipped.
- `StorageTracker`: a `TorchDispatchMode` above the fake mode that counts live storage bytes per
  device type as the CUDA caching allocator counts them (each storage once, views share it,
  rounded up to the allocator's 512-byte granule; freed when the storage dies: a weakref
  callback), with the peak since the last reset, as `torch.cuda.max_memory_allocated` reports it.
  It also records host syncs: reading a CUDA tensor's value on the host (`.item()`, `bool()`,
  `float()`, `.tolist()`) and copies from CUDA to the host, each with the h3 source line that
  asked; a fake tensor has no value, so the tracker answers with a neutral one (1, 1.0, False; True for
  `all()`) and the run goes on. And it answers SDPA's kernel choice (`_fused_sdp_choice`, which a
  CPU build cannot make for CUDA) with the first fused kernel the active `sdpa_kernel` priority
  allows, so attention takes the fused kernel's memory, never the math kernel's scores.

What a rank asks of its GPU beyond its tensors (compute capability, cuDNN, the fp4 GEMM's verdict,
memory statistics, timing) it asks through objects the dry run hands it (`DeviceKernels`, its
meter: `h3core.generate.dryrun.fakes`), never `torch.cuda`: nothing here patches torch.
- `fake_world(rank, world_size)`: the default process group as torch's fake backend (collectives
  return at once, data untouched: with fake tensors there is none), for one simulated rank.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import subprocess
import traceback
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

from h3core import settings

GUARD_SOURCE = """#include <c10/core/impl/DeviceGuardImplInterface.h>
C10_REGISTER_GUARD_IMPL(CUDA, c10::impl::NoOpDeviceGuardImpl<c10::DeviceType::CUDA>);
"""
"""The whole C++ extension: c10's no-op device guard, registered for CUDA when the library loads."""

ALLOCATOR_GRANULE = 512
"""The CUDA caching allocator rounds every block up to a multiple of 512 bytes (`kMinBlockSize`),
and `max_memory_allocated` counts the rounded sizes."""

_H3_ROOT = str(Path(__file__).resolve().parents[1])


# --- the device guard ---------------------------------------------------------------------------


NO_COMPILER = "no C++ compiler (c++ or g++, or $CXX) to build the no-op CUDA device guard a CPU-only torch needs for fake CUDA tensors"
"""The one reason a CPU build cannot make fake CUDA tensors that is the machine's, not h3's (tests skip on it alone)."""


def cuda_guard_problem() -> str | None:
    """None when fake CUDA tensors can be made and moved in this process, else why not (one line).
    Compiles and loads the no-op CUDA guard on a CPU build (cached; see the module docstring)."""
    return _guard_problem()


@functools.cache
def _guard_problem() -> str | None:
    if torch.backends.cuda.is_built():
        return None  # a CUDA build registers its own guard
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        return NO_COMPILER
    try:
        library = _built_guard(compiler)
        torch.ops.load_library(str(library))
    except (OSError, subprocess.SubprocessError) as err:
        return f"the no-op CUDA device guard did not build or load ({str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__})"
    return None


def _built_guard(compiler: str) -> Path:
    """The guard's shared library for this torch, compiled once into the cache folder."""
    torch_dir = Path(torch.__file__).parent
    key = hashlib.sha256(f"{GUARD_SOURCE}|{torch.__version__}|{torch_dir}|{compiler}".encode()).hexdigest()[:12]
    folder = settings.cache_dir() / "fake-cuda-guard"
    library = folder / f"h3_noop_cuda_guard-{key}.so"
    if library.is_file():
        return library
    folder.mkdir(parents=True, exist_ok=True)
    source = folder / f"h3_noop_cuda_guard-{key}.cpp"
    source.write_text(GUARD_SOURCE)
    staged = folder / f".{library.name}.{os.getpid()}"
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    command = [compiler, "-O1", "-shared", "-fPIC", "-std=c++17", abi, f"-I{torch_dir / 'include'}", str(source),
               f"-L{torch_dir / 'lib'}", "-lc10", f"-Wl,-rpath,{torch_dir / 'lib'}", "-o", str(staged)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise OSError(f"{Path(compiler).name} failed: {(done.stderr or done.stdout).strip()[-300:]}")
    os.replace(staged, library)  # whole or not at all: two processes may build it at once
    return library


# --- the tracker ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class HostSync:
    """One place where the run read a CUDA tensor on the host (the device must finish first)."""

    what: str  # "item" (a value read: .item(), bool(), float(), .tolist()) or "copy to host"
    op: str
    where: str  # the innermost h3 source line that asked (file:line function)
    phase: str


@dataclass
class DeviceCount:
    live: int = 0
    peak: int = 0  # since the last reset
    highest: int = 0  # since the tracker began (never reset)


class StorageTracker(TorchDispatchMode):
    """Live storage bytes per device type and their peak; host syncs; SDPA's kernel choice (module docstring).

    Enter it inside a `FakeTensorMode` (it then sees every operation first, with fake tensors)."""

    def __init__(self, sites: bool = False) -> None:
        super().__init__()
        self.sites = sites
        """Also record which h3 line made each live storage, and what was alive at the highest peak
        (`at_peak`): slower (a stack walk per allocation), for explaining a peak."""
        self.at_peak: dict[str, list[tuple[int, str, str]]] = {}
        self._live: dict[str, dict[int, tuple[int, str, str]]] = {}
        self.devices: dict[str, DeviceCount] = {}
        self.syncs: list[HostSync] = []
        self.phase = "load"
        self._seen: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._truth: WeakIdKeyDictionary = WeakIdKeyDictionary()  # outputs of all(): read back as True
        self._refs: list[Any] = []

    # --- counting ---

    def live(self, device_type: str = "cuda") -> int:
        return self.devices.get(device_type, DeviceCount()).live

    def peak(self, device_type: str = "cuda") -> int:
        return self.devices.get(device_type, DeviceCount()).peak

    def highest(self, device_type: str = "cuda") -> int:
        """The peak since the tracker began (resets do not lower it)."""
        return self.devices.get(device_type, DeviceCount()).highest

    def reset_peak(self, device_type: str = "cuda") -> None:
        count = self.devices.setdefault(device_type, DeviceCount())
        count.peak = count.live

    def _track(self, t: torch.Tensor) -> None:
        if t.device.type == "meta":
            return
        storage = t.untyped_storage()
        if storage in self._seen:
            return
        nbytes = _rounded(storage.nbytes()) if t.device.type == "cuda" else storage.nbytes()
        self._seen[storage] = nbytes
        kind = t.device.type
        count = self.devices.setdefault(kind, DeviceCount())
        count.live += nbytes
        count.peak = max(count.peak, count.live)
        key = id(storage)
        if self.sites:
            self._live.setdefault(kind, {})[key] = (nbytes, _h3_frame(), f"{str(t.dtype).removeprefix('torch.')} {list(t.shape)}")
        if count.live > count.highest:
            count.highest = count.live
            if self.sites:
                self.at_peak[kind] = list(self._live[kind].values())
        weakref.finalize(storage, self._freed, kind, nbytes, key)

    def _freed(self, device_type: str, nbytes: int, key: int) -> None:
        self.devices[device_type].live -= nbytes
        if self.sites:
            self._live.get(device_type, {}).pop(key, None)

    # --- the dispatch ---

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func in _VALUE_READS:
            return self._value_read(func, args[0])
        if func is torch.ops.aten._fused_sdp_choice.default and args[0].device.type == "cuda":
            return _first_fused_kernel(args[0])
        if func in _COPIES and _copies_to_host(func, args, kwargs):
            self._sync("copy to host", func)
        out = func(*args, **kwargs)
        for t in _tensors(out):
            self._track(t)
            if func in _ALL_OPS:
                self._truth[t] = True
        return out

    def _value_read(self, func: Any, t: torch.Tensor) -> Any:
        if t.device.type == "cuda":
            self._sync("item", func)
        if t.dtype is torch.bool or func is torch.ops.aten.is_nonzero.default:
            return bool(self._truth.get(t, False))
        return 1.0 if t.is_floating_point() else 1

    def _sync(self, what: str, func: Any) -> None:
        self.syncs.append(HostSync(what, str(func.overloadpacket.__name__), _h3_frame(), self.phase))


_VALUE_READS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default, torch.ops.aten.item.default}
_ALL_OPS = {torch.ops.aten.all.default, torch.ops.aten.all.dim, torch.ops.aten.all.dims}
_COPIES = {torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default}


def _copies_to_host(func: Any, args: tuple, kwargs: dict) -> bool:
    if func is torch.ops.aten.copy_.default:
        dest, src = args[0], args[1]
        return dest.device.type == "cpu" and src.device.type == "cuda"
    target = kwargs.get("device")
    return args[0].device.type == "cuda" and target is not None and torch.device(target).type == "cpu"


def _tensors(out: Any) -> Iterator[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        yield out
    elif isinstance(out, (tuple, list)):
        for item in out:
            yield from _tensors(item)


def _rounded(nbytes: int) -> int:
    return max(ALLOCATOR_GRANULE, -(-nbytes // ALLOCATOR_GRANULE) * ALLOCATOR_GRANULE) if nbytes else 0


def _h3_frame() -> str:
    """The innermost frame in h3's own code (outside this module): 'path:line function'."""
    for frame in reversed(traceback.extract_stack()):
        if frame.filename.startswith(_H3_ROOT) and not frame.filename.endswith("fake_cuda.py"):
            return f"{Path(frame.filename).relative_to(Path(_H3_ROOT).parent)}:{frame.lineno} {frame.name}"
    return "outside h3"


def _first_fused_kernel(q: torch.Tensor) -> int:
    """What `_fused_sdp_choice` answers on a GPU for q [B, H, S, Dh]: the first enabled fused kernel in
    the active priority order (h3's rule sets both) that takes the dtype and head width."""
    from torch.nn.attention import SDPBackend

    cuda = torch.backends.cuda
    half = q.dtype in (torch.float16, torch.bfloat16)
    takes = {
        int(SDPBackend.FLASH_ATTENTION): cuda.flash_sdp_enabled() and half and q.shape[-1] <= 256,
        int(SDPBackend.EFFICIENT_ATTENTION): cuda.mem_efficient_sdp_enabled(),
        int(SDPBackend.CUDNN_ATTENTION): cuda.cudnn_sdp_enabled() and half and q.shape[-1] <= 128,
    }
    for backend in torch._C._get_sdp_priority_order():
        if takes.get(int(backend), False):
            return int(backend)
    return int(SDPBackend.MATH)


# --- a fake process group ---------------------------------------------------------------------------


@contextmanager
def fake_world(rank: int, world_size: int) -> Iterator[Any]:
    """The default process group as torch's fake backend, this process as `rank` of `world_size`;
    yields the WORLD group (None at one rank). Refuses where a process group already exists."""
    import torch.distributed as dist

    if world_size == 1:
        yield None
        return
    if dist.is_initialized():
        raise RuntimeError("a process group exists in this process; a dry run simulates its ranks in a process of its own")
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    from h3core.runtime.context import leave_group

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield dist.group.WORLD
    finally:
        leave_group()
