"""What crosses the pipe between a spawned rank and its parent: results (tensors moved to the CPU)
and errors (the rank's own `H3Error`, or a `RankFailure` naming its type, with its traceback)."""

from __future__ import annotations

import pickle
import signal
import traceback
from dataclasses import dataclass
from typing import Any

from h3core.errors import H3Error, RankFailure


class RemoteTraceback(Exception):
    """The traceback of an exception raised in a worker, chained as the cause of what `run` raises."""

    def __init__(self, text: str):
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return f"\n\nTraceback in the rank (most recent call last):\n{self.text}"


@dataclass
class RankError:
    """An exception a rank raised, in a form that always survives the pipe."""

    rank: int
    type_name: str
    message: str
    traceback: str
    pickled: bytes | None  # the exception itself, when it pickles and is an H3Error

    @classmethod
    def of(cls, rank: int, exc: BaseException) -> "RankError":
        pickled = None
        if isinstance(exc, H3Error):
            try:
                pickled = pickle.dumps(exc)
                pickle.loads(pickled)
            except Exception:
                pickled = None
        text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        return cls(rank, type(exc).__name__, str(exc), text, pickled)

    def to_exception(self, world_size: int) -> H3Error:
        """The H3Error the rank raised (message prefixed with its rank), else a RankFailure."""
        err: H3Error | None = None
        if self.pickled is not None:
            try:
                err = pickle.loads(self.pickled)
            except Exception:
                err = None
        if err is None:
            err = RankFailure(self.rank, f"{self.type_name}: {self.message}")
        elif world_size > 1 and not isinstance(err, RankFailure) and len(err.args) == 1 and isinstance(err.args[0], str):
            err.args = (f"rank {self.rank}: {err.args[0]}",)
        err.__cause__ = RemoteTraceback(self.traceback)
        return err


def describe_exit(exitcode: int | None) -> str:
    if exitcode is None:
        return "process stopped responding"
    if exitcode < 0:
        try:
            return f"process killed by signal {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"process killed by signal {-exitcode}"
    return f"process exited with code {exitcode}"


def to_cpu(value: Any) -> Any:
    """Tensors (also inside lists, tuples and dicts) moved to the CPU, ready to cross the pipe."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {key: to_cpu(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        return type(value)(to_cpu(item) for item in value)
    return value
