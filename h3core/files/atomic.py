"""The one atomic writer: a file appears whole under its name, or not at all.

`atomic_file(path)` yields a temp path beside `path` (same folder: same file system, so the final
rename is atomic); whatever the block writes there is flushed to disk and renamed over `path` when
the block ends normally, and removed when it raises. `write_atomic(path, data)` is the bytes form.
Reports, output folders, checkpoints and safetensors files all write through it.
"""

from __future__ import annotations

import os
import secrets
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


@contextmanager
def atomic_file(path: Path | str) -> Iterator[Path]:
    """A temp path to write `path`'s content to; synced and renamed onto `path` on success."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(2)}.tmp")
    try:
        yield tmp
        _sync(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_atomic(path: Path | str, data: bytes) -> Path:
    """Write `data` to `path` all or nothing; returns `path`."""
    with atomic_file(path) as tmp:
        with open(tmp, "xb") as f:  # a new file: never through a link planted under the temp name
            f.write(data)
    return Path(path)


def _sync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
