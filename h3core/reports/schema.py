"""What every report shares: pydantic models written as JSON, versions, latent checksums, the one
error metric, and the one way from a report to an exit code.

- `report_json(report)`: the bytes every report file holds (indented JSON and a newline);
- `error_between(result, reference)`: max |result - reference| and max |reference| (every parity
  figure and every verify row is made of these two numbers);
- `Verdict`: a report that can fail (`failure()` gives the `CheckFailed` to exit with, or None); the
  CLI turns it into the exit code the same way for every command.
"""

from __future__ import annotations

import hashlib
import math
import platform
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Protocol

from pydantic import BaseModel, Field

from h3core import __version__
from h3core.errors import CheckFailed
from h3core.files.atomic import write_atomic


def report_json(report: BaseModel) -> bytes:
    """A report as its files hold it: indented JSON and a final newline."""
    return (report.model_dump_json(indent=2) + "\n").encode()


def write_report(path: Path, report: BaseModel) -> Path:
    """Write `report` to `path` atomically (outside an output folder; commands stage theirs in one)."""
    return write_atomic(path, report_json(report))


class Verdict(Protocol):
    """A report whose checks can fail: `failure()` is the error to exit with (None: exit 0)."""

    def failure(self) -> CheckFailed | None: ...


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
            sha256=hashlib.sha256(t.numpy().reshape(-1).view("uint8")).hexdigest(),  # the bytes in place: no copy of a clip
            sum=float(t.sum(dtype=t.dtype).item()),
            abs_mean=float(t.abs().mean().item()) if t.numel() else 0.0,
        )


def error_between(result: Any, reference: Any) -> tuple[float, float]:
    """`(max |result - reference|, max |reference|)`, computed in float64 on `result`'s device (0, 0
    for empty tensors; a NaN anywhere in the result makes the error NaN). The one error metric."""
    import torch

    if result.shape != reference.shape:
        raise ValueError(f"shape {list(result.shape)} vs reference {list(reference.shape)}")
    if result.numel() == 0:
        return 0.0, 0.0
    a = result.detach().to(torch.float64)
    b = reference.detach().to(device=a.device, dtype=torch.float64)
    diff = (a - b).abs().max().item()
    return (math.nan if torch.isnan(a).any().item() else diff), b.abs().max().item()


class ErrorStats(BaseModel):
    """How far a result is from its reference: max |a - b| and max |a - b| / max |b|."""

    max_abs: float
    relative: float

    @classmethod
    def between(cls, result: Any, reference: Any) -> "ErrorStats":
        diff, scale = error_between(result, reference)
        return cls(max_abs=diff, relative=diff / scale if scale else diff)
