"""The dry run's fakes: what a rank's pipeline is given instead of its real instruments
(`h3core.generate.instruments.RankInstruments`), so that the same load and denoise code runs on
tensors without data (`FakeTensorMode`) at the real shapes, on a GPU this process need not have.

| instrument | fake | what it does |
|---|---|---|
| `meter` | `TrackedMeter` | zero-time stopwatch; the peak window and live bytes of the `StorageTracker` (`h3core.runtime.fake_cuda`) |
| `kernels` | `DeviceKernels.simulated` | the predicted GPU's capability; its fp4 GEMM taken as passed; the fused quantizer launching (its launch op's fake writes nothing) |
| `host` | `FakeHost` | host arithmetic whose values decide shapes (positions, schedules, clocks) run on real host tensors, handed on as fake ones |
| `open_checkpoint` | `header_only_file` + `HeaderReader` | the checkpoint's header (or the synthetic layout's specs): every read a tensor of the slice's shape, counted as read, no byte read |

The process group is torch's fake backend (`fake_cuda.fake_world`), given to the rank as its
`RankContext.group`. Nothing is patched: every fake goes in through an argument.
"""

from __future__ import annotations

import weakref
from dataclasses import fields, is_dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence, TypeVar

import torch

from h3core.checkpoints.file import TransformerFile, _classify, open_transformer
from h3core.files.safetensors import SafetensorsReader, _Entry, converts_on_read
from h3core.generate.instruments import RankInstruments
from h3core.generate.request import ResolvedRun
from h3core.model.checkpoint import SYNTHETIC, WEIGHTS_KEY, Checkpoint, TensorSpec
from h3core.nvfp4 import comfy
from h3core.nvfp4.kernels import DeviceKernels
from h3core.runtime.fake_cuda import StorageTracker

if TYPE_CHECKING:
    from torch._subclasses.fake_tensor import FakeTensorMode

T = TypeVar("T")


# --- the meter and the host ---------------------------------------------------------------------------


class NoTime:
    """A stopwatch that measures nothing (a dry run's regions take no time)."""

    seconds = 0.0

    def __enter__(self) -> "NoTime":
        return self

    def __exit__(self, *exc: object) -> None:
        return None


class TrackedMeter:
    """A `DeviceMeter` over a `StorageTracker`: the peak window and its peak are the tracker's for
    `device`'s type (what `torch.cuda.max_memory_allocated` would report for the same storages)."""

    def __init__(self, device: torch.device, tracker: StorageTracker):
        self.device, self.tracker = device, tracker

    def stopwatch(self) -> NoTime:
        return NoTime()

    def reset_peak(self) -> None:
        self.tracker.reset_peak(self.device.type)

    def peak(self) -> int:
        return self.tracker.peak(self.device.type)

    def current(self) -> int:
        return self.tracker.live(self.device.type)


class FakeHost:
    """`HostValues` under a `FakeTensorMode`: `fn(*args)` runs outside the fake mode on real host
    tensors (its values decide shapes: `unique`, `tolist`), and the tensors it returns (a tensor, or
    the tensor fields of a dataclass) are handed on as fake ones, as everything else is."""

    def __init__(self, fake: "FakeTensorMode"):
        self.fake = fake

    def __call__(self, fn: Callable[..., T], *args: object) -> T:
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        with unset_fake_temporarily():
            out = fn(*args)
        return self._faked(out)

    def _faked(self, out: Any) -> Any:
        if isinstance(out, torch.Tensor):
            return self.fake.from_tensor(out)
        if is_dataclass(out) and not isinstance(out, type):
            tensors = {f.name: self.fake.from_tensor(getattr(out, f.name)) for f in fields(out) if isinstance(getattr(out, f.name), torch.Tensor)}
            return replace(out, **tensors)
        return out


FakeInstruments = Callable[[ResolvedRun, torch.device, StorageTracker, "FakeTensorMode", "tuple[int, int] | None"], RankInstruments]
"""What makes one rank's instruments for a dry run: (run, device, tracker, fake mode, GPU capability or None for the CPU)."""


def fake_instruments(run: ResolvedRun, device: torch.device, tracker: StorageTracker, fake: "FakeTensorMode",
                     capability: tuple[int, int] | None) -> RankInstruments:
    """A dry run's instruments for one rank of `run` on `device` (a GPU of `capability`, or the CPU when None)."""
    kernels = DeviceKernels.simulated(device, capability, _cudnn_version()) if capability is not None else DeviceKernels.of(device)
    file = header_only_file(run)
    return RankInstruments(meter=TrackedMeter(device, tracker), kernels=kernels, host=FakeHost(fake),
                           open_checkpoint=lambda run: Checkpoint(file, run.config))


def _cudnn_version() -> int | None:
    """This torch's cuDNN, as the GPU run's rule would read it (None on a CPU build)."""
    return torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None


# --- the checkpoint, header only -------------------------------------------------------------------------


class HeaderReader(SafetensorsReader):
    """A `SafetensorsReader` over a checkpoint's header: the same names, shapes and dtypes, and every read
    hands back an uninitialised tensor of the slice's shape (a fake one under FakeTensorMode), counted
    in `bytes_read` as the real read would be; no byte is read. `values`: small tensors returned as
    they are (the Comfy markers of a synthetic layout, which detection reads)."""

    def __init__(self, entries: dict[str, tuple[str, tuple[int, ...]]], metadata: dict[str, str], paths: Sequence[Path],
                 values: dict[str, torch.Tensor] | None = None):
        self.paths = [Path(p) for p in paths]
        self.bytes_read = 0
        self._entries = {name: _Entry(self.paths[0], -1, dtype, shape, 0) for name, (dtype, shape) in entries.items()}
        self._metadata = dict(metadata)
        self._fds: list[int] = []
        self._finalizer = weakref.finalize(self, lambda: None)
        self._values = values or {}

    @classmethod
    def of_reader(cls, reader: SafetensorsReader) -> "HeaderReader":
        return cls({n: (e.dtype, e.shape) for n, e in reader._entries.items()}, reader.metadata, reader.paths)

    @classmethod
    def of_specs(cls, specs: Sequence[TensorSpec], metadata: dict[str, str], path: Path, values: dict[str, torch.Tensor]) -> "HeaderReader":
        return cls({s.name: (s.dtype, s.shape) for s in specs}, metadata, [path], values)

    def _empty(self, name: str, shape: Sequence[int], dtype: torch.dtype | None = None) -> torch.Tensor:
        """A fake of what the real reader returns: in `dtype` when converting (`SafetensorsReader.get`), counted in stored bytes."""
        stored = self.dtype(name)
        converting = converts_on_read(stored, dtype)
        out = torch.empty(tuple(shape), dtype=dtype if converting else stored)
        self.bytes_read += out.numel() * stored.itemsize
        return out if dtype is None or converting else out.to(dtype)

    def get(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        if name in self._values:
            value = self._values[name]  # real bytes (read with .tolist(), which no fake mode sees)
            return value if dtype is None else value.to(dtype)
        return self._empty(name, self._entry(name).shape, dtype)

    def get_rows(self, name: str, rows, dtype: torch.dtype | None = None):  # type: ignore[no-untyped-def]
        shape = self._entry(name).shape
        for span in rows:
            self._check_span(name, span, shape[0], "rows")
        return self._empty(name, (sum(s.stop - s.start for s in rows), *shape[1:]), dtype)

    def get_columns(self, name: str, cols):  # type: ignore[no-untyped-def]
        shape = self._entry(name).shape
        self._check_span(name, cols, shape[-1], "columns")
        return self._empty(name, (*shape[:-1], cols.stop - cols.start))

    def get_bytes(self, name: str, ranges):  # type: ignore[no-untyped-def]
        self._entry(name)
        return self._empty_bytes(sum(s.stop - s.start for s in ranges))

    def _empty_bytes(self, n: int) -> torch.Tensor:
        self.bytes_read += n
        return torch.empty(n, dtype=torch.uint8)


def header_only_file(run: ResolvedRun) -> TransformerFile:
    """`run`'s checkpoint with a `HeaderReader`: the file's own header where the file exists, else the
    synthetic layout of `run.config` (what `h3 plan --memory` predicts for without building it)."""
    path = Path(run.checkpoint)
    if path.exists():
        file = open_transformer(path)
        real, file.reader = file.reader, HeaderReader.of_reader(file.reader)
        real.close()
        return file
    if not run.synthetic:
        raise RuntimeError(f"no checkpoint at {path} to read a header from")
    from h3core.model.synthetic import _NVFP4_MARKER, synthetic_specs

    specs = synthetic_specs(run.config)
    marker = comfy.marker_tensor(_NVFP4_MARKER)
    values = {s.name: marker for s in specs if s.name.endswith(f".{comfy.MARKER}")}
    reader = HeaderReader.of_specs(specs, {WEIGHTS_KEY: SYNTHETIC}, path, values)
    return _classify(path, reader, folder=False)
