"""Reports: pydantic models written atomically as JSON, and the small helpers every report uses."""

from __future__ import annotations

import hashlib
import os
import platform
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from h3core import __version__


def write_atomic(path: Path, data: bytes) -> Path:
    """Write `data` to `path` through a temp file in the same folder and a rename: all or nothing."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def write_report(path: Path, report: BaseModel) -> Path:
    return write_atomic(path, (report.model_dump_json(indent=2) + "\n").encode())


def timestamp() -> str:
    return datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")


class Versions(BaseModel):
    h3: str = __version__
    python: str = Field(default_factory=lambda: sys.version.split()[0])
    torch: str = ""
    cuda: str | None = None
    platform: str = Field(default_factory=platform.platform)

    @classmethod
    def collect(cls) -> "Versions":
        import torch

        return cls(torch=torch.__version__, cuda=torch.version.cuda)


class TensorChecksum(BaseModel):
    """Identity of a latent tensor: sha256 of its float32 bytes, plus numbers a person can compare."""

    shape: list[int]
    sha256: str
    sum: float
    abs_mean: float

    @classmethod
    def of(cls, tensor: Any) -> "TensorChecksum":
        t = tensor.detach().float().contiguous().cpu()
        return cls(
            shape=list(t.shape),
            sha256=hashlib.sha256(t.numpy().tobytes()).hexdigest(),
            sum=float(t.sum(dtype=t.dtype).item()),
            abs_mean=float(t.abs().mean().item()) if t.numel() else 0.0,
        )


class ErrorStats(BaseModel):
    """How far a result is from its reference: max |a - b| and max |a - b| / max |b|."""

    max_abs: float
    relative: float

    @classmethod
    def between(cls, result: Any, reference: Any) -> "ErrorStats":
        a, b = result.detach().double().cpu(), reference.detach().double().cpu()
        if a.shape != b.shape:
            raise ValueError(f"shape {list(a.shape)} vs reference {list(b.shape)}")
        diff = (a - b).abs().max().item() if a.numel() else 0.0
        scale = b.abs().max().item() if b.numel() else 0.0
        return cls(max_abs=diff, relative=diff / scale if scale else diff)
