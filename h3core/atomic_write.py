"""Writing output files so that a reader never sees half of one: temp file + fsync + os.replace."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from pydantic import BaseModel


def write_atomic(path: Path, data: bytes | str) -> Path:
    """Write `data` to `path` in one step (the parent folder is created); returns `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = data.encode() if isinstance(data, str) else data
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_json(path: Path, value: BaseModel | dict | list) -> Path:
    """A pydantic model (or plain data) as indented JSON, atomically."""
    data = value.model_dump(mode="json") if isinstance(value, BaseModel) else value
    return write_atomic(path, json.dumps(data, indent=2) + "\n")
