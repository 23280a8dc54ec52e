"""Safetensors files, read lazily and written atomically: no knowledge of what the tensors mean.

`SafetensorsReader` opens one file or the shards of one checkpoint and reads whole tensors, row
ranges or column ranges, only the requested bytes (`bytes_read` counts them): a tensor-parallel
rank reads only its slice of a weight. `write_safetensors` writes a file through the one atomic
writer (`h3core.files.atomic`). The H3 checkpoint (`h3core.model.checkpoint`), NVFP4 linears
(`h3core.nvfp4.io`) and the text encoder (`h3core.text`) all read through this reader.

Ranges are anything with `start` and `stop` (h3's `Span`, or a `range`).
"""

from __future__ import annotations

import math
import os
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, Sequence

import torch
from safetensors.torch import save_file

from h3core.errors import CheckpointError
from h3core.files.atomic import atomic_file
from h3core.files.paths import inside, path_kind
from h3core.files.text import MAX_CONFIG_BYTES, parse_json, read_json


class Range(Protocol):
    """Items `[start, stop)` of one axis (a `Span`, a `range`)."""

    @property
    def start(self) -> int: ...

    @property
    def stop(self) -> int: ...


INDEX_FILE = "model.safetensors.index.json"
"""Hugging Face's map of a sharded checkpoint: {"weight_map": {tensor name: shard file}}."""

_DTYPES: dict[str, torch.dtype] = {
    "U8": torch.uint8,
    "I8": torch.int8,
    "I32": torch.int32,
    "I64": torch.int64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "BOOL": torch.bool,
}
FLOAT_DTYPE_NAMES = ("F16", "BF16", "F32", "F64")


@dataclass(frozen=True)
class _Entry:
    """Where one tensor's bytes are: file, absolute offset, dtype and shape (from the file's header)."""

    path: Path
    fd: int
    dtype: str
    shape: tuple[int, ...]
    offset: int


class SafetensorsReader:
    """Lazy reader over one safetensors file or the shards of one checkpoint.

    Opening checks every file's header (`read_header`: a truncated or corrupt file fails here,
    naming the file) and keeps each header's tensor offsets. Data is read only when asked for, and only the
    requested byte ranges, with `pread` on a descriptor advised `POSIX_FADV_RANDOM`: the kernel then
    reads the pages asked for and no read-ahead around them. (Slicing through `safe_open`'s memory
    map lets the kernel read ahead around every touched region: with this project's 8 MiB windows,
    reading rank 0 of 8's QKV rows paged in the whole tensor.) Row ranges are one read each;
    column ranges one read per row, so a column slice touches fewer disk pages only where rows are
    wider than a page. `bytes_read` counts the bytes of every tensor or slice returned.
    """

    def __init__(self, paths: Sequence[Path | str]):
        self.paths = [Path(p) for p in paths]
        if not self.paths:
            raise CheckpointError("no safetensors files given; point H3_MODEL_PATH at a checkpoint file or folder")
        self.bytes_read = 0
        self._staging: torch.Tensor | None = None  # `_fill_converting`'s buffer, made at its first use
        self._entries: dict[str, _Entry] = {}
        self._metadata: dict[str, str] = {}
        self._fds: list[int] = []
        self._finalizer = weakref.finalize(self, _close_all, self._fds)
        for path in self.paths:
            self._index(path)

    @classmethod
    def open(cls, path: Path | str) -> "SafetensorsReader":
        """A file, or a folder holding `model.safetensors.index.json` or `*.safetensors` shards."""
        path = Path(path)
        if path.is_dir():
            return cls(shard_files(path))
        return cls([path])

    def _index(self, path: Path) -> None:
        if not path.is_file():
            kind = path_kind(path, follow=True)
            what = "does not exist" if kind == "nothing" else f"is {kind}, not a file"
            raise CheckpointError(f"checkpoint file {path} {what}; check the path (H3_MODEL_PATH)")
        header, data_start, metadata = read_header(path)
        fd = os.open(path, os.O_RDONLY)
        self._fds.append(fd)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        for name, info in header.items():
            if name in self._entries:
                raise CheckpointError(
                    f"tensor {name} is in both {self._entries[name].path} and {path}; use one checkpoint's shards"
                )
            self._entries[name] = _Entry(path, fd, info["dtype"], tuple(info["shape"]), data_start + info["data_offsets"][0])
        for key, value in metadata.items():
            self._metadata.setdefault(key, value)

    def close(self) -> None:
        """Close the files (also done when the reader is garbage collected)."""
        self._finalizer()

    def __enter__(self) -> "SafetensorsReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def metadata(self) -> dict[str, str]:
        """The files' `__metadata__` merged (the first file wins on a conflicting key)."""
        return dict(self._metadata)

    def keys(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def file_of(self, name: str) -> Path:
        return self._entry(name).path

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entry(name).shape

    def dtype_name(self, name: str) -> str:
        """The safetensors dtype string (`U8`, `F8_E4M3`, `F32`, `BF16`, ...)."""
        return self._entry(name).dtype

    def dtype(self, name: str) -> torch.dtype:
        entry = self._entry(name)
        if entry.dtype not in _DTYPES:
            raise CheckpointError(f"tensor {name} in {entry.path} has dtype {entry.dtype}, which h3 does not read")
        return _DTYPES[entry.dtype]

    def nbytes(self, name: str) -> int:
        """Bytes of a tensor's data."""
        entry = self._entry(name)
        return math.prod(entry.shape) * _ITEM_BYTES[entry.dtype]

    def get(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The whole tensor; in `dtype` (floating point, the stored dtype too) converted as it is read
        (`_fill_converting`), else in its stored dtype."""
        entry = self._entry(name)
        return self._read(name, entry.shape, [(entry.offset, 0, math.prod(entry.shape) * _ITEM_BYTES[entry.dtype])], dtype)

    def get_rows(self, name: str, rows: Sequence[Range], dtype: torch.dtype | None = None) -> torch.Tensor:
        """Rows (dim 0) `rows` of a tensor, concatenated in order: one read per span (`dtype` as `get`)."""
        entry = self._entry(name)
        if not rows or not entry.shape:
            raise CheckpointError(f"cannot take rows {list(rows)} of {name} (shape {list(entry.shape)})")
        for span in rows:
            self._check_span(name, span, entry.shape[0], "rows")
        row_bytes = math.prod(entry.shape[1:]) * _ITEM_BYTES[entry.dtype]
        reads, at = [], 0
        for span in rows:
            reads.append((entry.offset + span.start * row_bytes, at, (span.stop - span.start) * row_bytes))
            at += (span.stop - span.start) * row_bytes
        return self._read(name, (sum(s.stop - s.start for s in rows), *entry.shape[1:]), reads, dtype)

    def _read(self, name: str, shape: Sequence[int], reads: list[tuple[int, int, int]], dtype: torch.dtype | None) -> torch.Tensor:
        stored = self.dtype(name)
        if not converts_on_read(stored, dtype):
            out = torch.empty(tuple(shape), dtype=stored)
            self._fill(name, _bytes_of(out), reads)
            return out if dtype is None else out.to(dtype)
        out = torch.empty(tuple(shape), dtype=dtype)
        self._fill_converting(name, out.view(-1), stored, reads)
        return out

    def get_columns(self, name: str, cols: Range) -> torch.Tensor:
        """Columns (last dim) `cols` of a 1-D or 2-D tensor, compact: one read per row."""
        entry = self._entry(name)
        if len(entry.shape) not in (1, 2):
            raise CheckpointError(
                f"tensor {name} has shape {list(entry.shape)}; only 1-D or 2-D tensors have column ranges"
            )
        self._check_span(name, cols, entry.shape[-1], "columns")
        rows = entry.shape[0] if len(entry.shape) == 2 else 1
        out = torch.empty((*entry.shape[:-1], (cols.stop - cols.start)), dtype=self.dtype(name))
        item = out.element_size()
        row_bytes, piece = entry.shape[-1] * item, (cols.stop - cols.start) * item
        reads = [(entry.offset + r * row_bytes + cols.start * item, r * piece, piece) for r in range(rows)]
        self._fill(name, _bytes_of(out), reads)
        return out

    def get_bytes(self, name: str, ranges: Sequence[Range]) -> torch.Tensor:
        """Byte ranges `[start, stop)` of a tensor's data, concatenated: a flat uint8 tensor (one read
        per range). What a reader of a tiled layout (the 128x4 swizzled NVFP4 scales) slices with."""
        entry = self._entry(name)
        total = math.prod(entry.shape) * _ITEM_BYTES[entry.dtype]
        for span in ranges:
            self._check_span(name, span, total, "bytes")
        out = torch.empty(sum(s.stop - s.start for s in ranges), dtype=torch.uint8)
        reads, at = [], 0
        for span in ranges:
            reads.append((entry.offset + span.start, at, span.stop - span.start))
            at += span.stop - span.start
        self._fill(name, _bytes_of(out), reads)
        return out

    def _entry(self, name: str) -> _Entry:
        if not self._finalizer.alive:  # its descriptor numbers may belong to other files by now
            raise ValueError(f"reading {name} from a closed SafetensorsReader")
        if name not in self._entries:
            files = ", ".join(str(p) for p in self.paths)
            raise CheckpointError(
                f"tensor {name} is not in {files}; the checkpoint does not match this model "
                f"(wrong file, preset or export)"
            )
        return self._entries[name]

    def _fill(self, name: str, dest: memoryview, reads: list[tuple[int, int, int]]) -> None:
        """Read `(file offset, dest offset, length)` ranges of `name`'s file into `dest`."""
        entry = self._entry(name)
        for offset, at, length in reads:
            view = dest[at : at + length]
            while view.nbytes:
                got = os.preadv(entry.fd, [view], offset)
                if got <= 0:
                    raise CheckpointError(
                        f"{entry.path} ended while reading {name}; the file is truncated: download it again"
                    )
                view, offset = view[got:], offset + got
            self.bytes_read += length

    def _fill_converting(self, name: str, flat: torch.Tensor, stored: torch.dtype, reads: list[tuple[int, int, int]]) -> None:
        """`_fill` into `flat` (another floating dtype than `stored`; dest offsets in stored bytes)
        through one reused staging buffer of `STAGING_BYTES`, each piece converted by `copy_` (the
        same rounding as `.to`). The stored-dtype copy is never allocated whole: reading a bf16 file
        to float32 touched fresh pages for both (`scripts/bench_load.py --before`: h3-2blocks to the CPU in
        float32, 1.86 -> 1.40 s, median of 5)."""
        item = stored.itemsize
        if self._staging is None:
            self._staging = torch.empty(STAGING_BYTES, dtype=torch.uint8)
        staging, staged = self._staging, _bytes_of(self._staging)
        for offset, at, length in reads:
            done = 0
            while done < length:
                k = min(STAGING_BYTES, length - done)  # a whole number of items: both are multiples of the item size
                self._fill(name, staged, [(offset + done, 0, k)])
                flat[(at + done) // item : (at + done + k) // item].copy_(staging[:k].view(stored))
                done += k

    def _check_span(self, name: str, span: Range, size: int, what: str) -> None:
        if span.stop > size:
            raise CheckpointError(
                f"{what} [{span.start}, {span.stop}) of {name} are out of range (it has {size}) in "
                f"{self.file_of(name)}; the checkpoint's shapes do not match the model config"
            )


def converts_on_read(stored: torch.dtype, dtype: torch.dtype | None) -> bool:
    """Whether a read of a `stored` tensor asked for in `dtype` converts as it reads (another floating
    dtype); otherwise it reads as stored and converts after, if asked."""
    return dtype is not None and dtype != stored and dtype.is_floating_point and stored.is_floating_point


STAGING_BYTES = 16 << 20
"""The buffer a converting read goes through (`SafetensorsReader._fill_converting`): a multiple of every item size."""

MAX_HEADER_BYTES = 100_000_000
"""safetensors' own cap on the JSON header (100 MB)."""

_ITEM_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
               "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}


def read_header(path: Path) -> tuple[dict[str, Any], int, dict[str, str]]:
    """The tensors of a safetensors file's header, where its data starts, and its `__metadata__`.

    Checked as the format says (a JSON object of `{dtype, shape, data_offsets}`, known dtypes,
    offsets that tile the data from 0 without gaps or overlaps, each tensor's bytes its shape's)
    and that the file holds every byte the header points at. Bytes *after* the last tensor are
    accepted: the seed's NVFP4 checkpoint carries 65 of them, which `safe_open` refuses.
    """
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            prefix = f.read(8)
            length = int.from_bytes(prefix, "little") if len(prefix) == 8 else -1
            if not 2 <= length <= min(MAX_HEADER_BYTES, size - 8):
                raise ValueError("the header length is not valid")
            raw = f.read(length)
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{path} is not a readable safetensors file ({err}); it may be truncated or corrupt: download it again") from None
    header = parse_json(raw, f"{path} is not a readable safetensors file (its header)", "the file is corrupt or not safetensors: download it again",
                        error=CheckpointError, limit=MAX_HEADER_BYTES, want=dict)
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CheckpointError(f"{path}: its safetensors __metadata__ is not a map of strings; the file is corrupt")
    extents = []
    for name, info in header.items():
        problem = _entry_problem(info)
        if problem:
            raise CheckpointError(f"{path}: tensor {name!r} in the header {problem}; the file is corrupt or not safetensors")
        extents.append((info["data_offsets"][0], info["data_offsets"][1], name))
    end = 0
    for start, stop, name in sorted(extents):
        if start != end:
            raise CheckpointError(f"{path}: tensor {name!r} starts at byte {start} of the data, expected {end} (a gap or an overlap); the file is corrupt")
        end = stop
    data_start = 8 + length
    if data_start + end > size:
        raise CheckpointError(
            f"{path} holds {size - data_start} data bytes but its header points at {end}; the file is truncated: download it again"
        )
    return header, data_start, metadata


def _entry_problem(info: Any) -> str | None:
    """Why one header entry is not a safetensors tensor (None when it is)."""
    if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
        return "is not {dtype, shape, data_offsets}"
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if dtype not in _ITEM_BYTES:
        return f"has an unknown dtype {dtype!r}"
    if not isinstance(shape, list) or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape):
        return f"has an invalid shape {shape!r}"
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(n, int) and not isinstance(n, bool) for n in offsets)):
        return f"has invalid data_offsets {offsets!r}"
    count = 1
    for n in shape:
        count *= n
    if not 0 <= offsets[0] <= offsets[1] or offsets[1] - offsets[0] != count * _ITEM_BYTES[dtype]:
        return f"holds {offsets[1] - offsets[0]} bytes, not the {count * _ITEM_BYTES[dtype]} of {dtype} {shape}"
    return None


def _bytes_of(t: torch.Tensor) -> memoryview:
    """A writable byte view of a fresh contiguous tensor (safetensors data is little-endian, as are our hosts)."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _close_all(fds: list[int]) -> None:
    while fds:
        os.close(fds.pop())


def shard_files(folder: Path, index_name: str = INDEX_FILE) -> list[Path]:
    """The shard files of a checkpoint folder: those its index (`index_name`) names, else every `*.safetensors`.

    The index is checked: a JSON object whose `weight_map` maps names to file names inside the
    folder (no absolute paths, no `..`), every one of which exists.
    """
    index = folder / index_name
    if index.is_file():
        return index_shards(index)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{folder} holds no *.safetensors files; point H3_MODEL_PATH at a checkpoint")
    return files


def index_shards(index: Path) -> list[Path]:
    """The shard files a safetensors index (`{"weight_map": {tensor name: file name}}`) names, in
    order of first mention: each a file name inside the index's folder (no absolute path, no `..`)
    that exists. Every other index is one `CheckpointError` line naming it."""
    hint = "download it again"
    data = read_json(index, "the safetensors index", MAX_CONFIG_BYTES, hint, error=CheckpointError, want=dict)
    weight_map = data.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{index} is not a valid safetensors index (its weight_map is not a map of tensor names to file names); {hint}")
    folder, files = index.parent, []
    for name in dict.fromkeys(weight_map.values()):
        shard = inside(folder, name)
        if shard is None:
            raise CheckpointError(f"{index} points at {name!r}, outside its folder; the index is corrupt or hostile: {hint}")
        if not shard.is_file():
            raise CheckpointError(f"{index} names shard {name}, which is not in {folder}; the download is incomplete")
        files.append(shard)
    return files


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> Path:
    """Write `tensors` (made contiguous) to `path` atomically, with `metadata` in the header."""
    with atomic_file(path) as tmp:
        save_file({name: t.contiguous() for name, t in tensors.items()}, str(tmp), metadata=metadata)
    return Path(path)
