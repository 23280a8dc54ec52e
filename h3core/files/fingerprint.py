"""What a file or folder of weights holds, in a few bytes: the identity a run's result depends on.

A checkpoint is many gigabytes; hashing it whole on every run would cost a minute. `content_id(path)`
is cheap and still changes when the weights do: sha256 over the file's size, its safetensors
header (every tensor's name, dtype, shape and offset; for another kind of file its first MiB)
and `SAMPLES` blocks of `BLOCK_BYTES` spread evenly over the rest, the last block included:
other weights of the same layout differ in every sampled block. It reads about 4 MiB whatever
the size, and is cached (`H3_CACHE_DIR/fingerprints/`) under the file's device, inode, size,
modification and change times, so that it is read again only when the file changed. A folder
(a text encoder's) is the id of its regular files' names and ids.

`file_identity(path, portable)` is what a request's fingerprint records: the content id, plus the
modification time unless `portable`. The modification time makes a resume refuse weights edited
in place even where no sampled byte changed; `portable` leaves it out for what must agree between
machines holding their own copies of the same file (torchrun's ranks).

A file that cannot be read gives an id that says so (`unreadable: ...`): the loader reports it.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path

from h3core import settings
from h3core.errors import ConfigError
from h3core.files.atomic import write_atomic
from h3core.files.text import read_json

SAMPLES = 64
BLOCK_BYTES = 64 << 10
HEAD_BYTES = 1 << 20  # of a file that is not safetensors
MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit for its JSON header
MAX_FOLDER_FILES = 10_000
VERSION = "h3-content-1"

_memo: dict[tuple, str] = {}
"""Content ids by file identity (path, device, inode, size, times): a memo of a pure function of the
file, owned by the process (a changed file has another key: nothing in it can go stale or belong to
one request)."""


def content_id(path: Path | str) -> str:
    """The content id of a file, or of a folder's regular files (module docstring)."""
    path = Path(path)
    try:
        info = os.stat(path)
    except OSError as err:
        return f"unreadable: {err.strerror}"
    if stat.S_ISDIR(info.st_mode):
        return _folder_id(path)
    if not stat.S_ISREG(info.st_mode):
        return "unreadable: not a regular file"
    key = (str(path.resolve()), info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns)
    if key not in _memo:
        _memo[key] = _cached(key) or _remember(key, _file_id(path, info.st_size))
    return _memo[key]


def file_identity(path: Path | str, portable: bool = False) -> dict[str, object]:
    """{'content': content_id, 'modified_ns': mtime} (without the time when `portable`)."""
    identity: dict[str, object] = {"content": content_id(path)}
    if not portable:
        try:
            identity["modified_ns"] = _modified_ns(Path(path))
        except OSError:
            identity["modified_ns"] = None
    return identity


def _modified_ns(path: Path) -> int:
    if not path.is_dir():
        return os.stat(path).st_mtime_ns
    return max([os.stat(path).st_mtime_ns, *(os.stat(f).st_mtime_ns for _, f in _regular_files(path))])


def _file_id(path: Path, size: int) -> str:
    digest = hashlib.sha256(f"{VERSION}|{size}|".encode())
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            header_len = int.from_bytes(head, "little") if len(head) == 8 else -1
            if 0 < header_len <= min(MAX_HEADER_BYTES, size - 8):  # a safetensors file: the whole header
                body_start = 8 + header_len
                digest.update(head + f.read(header_len))
            else:
                body_start = min(size, HEAD_BYTES)
                f.seek(0)
                digest.update(f.read(body_start))
            for offset in _sample_offsets(body_start, size):
                f.seek(offset)
                digest.update(f.read(BLOCK_BYTES))
    except OSError as err:
        return f"unreadable: {err.strerror}"
    return digest.hexdigest()


def _sample_offsets(start: int, size: int) -> list[int]:
    """`SAMPLES` block starts spread evenly over [start, size), the last block included."""
    span = size - start
    if span <= 0:
        return []
    if span <= SAMPLES * BLOCK_BYTES:
        return list(range(start, size, BLOCK_BYTES))
    last = size - BLOCK_BYTES
    return sorted({start + (last - start) * i // (SAMPLES - 1) for i in range(SAMPLES)})


def _regular_files(folder: Path) -> list[tuple[str, Path]]:
    found: list[tuple[str, Path]] = []
    for root, dirs, files in os.walk(folder):  # links to folders are not followed
        dirs.sort()
        for name in sorted(files):
            path = Path(root) / name
            if path.is_file():  # a regular file, or a link to one (a Hugging Face snapshot's blobs)
                found.append((str(path.relative_to(folder)), path))
            if len(found) > MAX_FOLDER_FILES:
                return found
    return found


def _folder_id(folder: Path) -> str:
    files = _regular_files(folder)
    if len(files) > MAX_FOLDER_FILES:
        return f"unreadable: more than {MAX_FOLDER_FILES} files"
    digest = hashlib.sha256(f"{VERSION}|folder|".encode())
    for relative, path in files:
        digest.update(f"{relative}\0{content_id(path)}\0".encode())
    return digest.hexdigest()


# --- the cache: a hint, never trusted beyond its key -------------------------------------------


def _cache_file(key: tuple) -> Path:
    return settings.cache_dir() / "fingerprints" / f"{hashlib.sha256(key[0].encode()).hexdigest()[:32]}.json"


def _cached(key: tuple) -> str | None:
    """The id cached for exactly this file state (device, inode, size, times), else None."""
    try:
        data = read_json(_cache_file(key), "a fingerprint cache file", 64 << 10, "it is rebuilt")
    except ConfigError:
        return None
    if not isinstance(data, dict) or data.get("key") != list(key) or not isinstance(data.get("content"), str):
        return None
    return data["content"]


def _remember(key: tuple, content: str) -> str:
    if not content.startswith("unreadable"):
        try:
            write_atomic(_cache_file(key), json.dumps({"key": list(key), "content": content}).encode())
        except OSError:
            pass  # a cache that cannot be written only costs the next run one more read
    return content
