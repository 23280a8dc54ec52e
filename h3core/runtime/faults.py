"""Fault injection for tests: `H3_INJECT_FAULT` makes a chosen rank fail at a chosen point.

`POINT[:INDEX]@RANK[:ACTION]` (comma-separated for several), e.g. `step:2@1` (rank 1 raises at
denoising step 2) or `iter:1@1:kill`. INDEX and RANK may be `*` (any). ACTION: `raise`
(RuntimeError, default), `config` (ConfigError), `kill` (the rank SIGKILLs itself), `exit`
(`os._exit(3)`) or `stop` (the rank SIGSTOPs itself: a stalled rank, as `kill -STOP` makes one).
Code marks its points with `maybe_inject_fault(point, rank, index)`: a no-op when the variable is unset.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass

from h3core import settings
from h3core.errors import ConfigError

FAULT_ENV = settings.INJECT_FAULT


@dataclass(frozen=True)
class FaultSpec:
    """One entry of H3_INJECT_FAULT: `POINT[:INDEX]@RANK[:ACTION]`, e.g. `step:2@1` or `step:2@1:kill`.

    INDEX and RANK may be `*` (any). ACTION: `raise` (RuntimeError, default), `config`
    (ConfigError), `kill` (the rank SIGKILLs itself), `exit` (`os._exit(3)`) or `stop` (the rank
    SIGSTOPs itself: a stalled rank, as `kill -STOP` makes one).
    """

    point: str
    index: int | None
    rank: int | None
    action: str = "raise"

    def matches(self, point: str, rank: int, index: int | None) -> bool:
        return (
            self.point == point
            and (self.rank is None or self.rank == rank)
            and (self.index is None or self.index == index)
        )


FAULT_ACTIONS = ("raise", "config", "kill", "exit", "stop")


def parse_fault_specs(text: str) -> list[FaultSpec]:
    """'step:2@1,step:0@3:kill' -> FaultSpecs; a malformed entry is a ConfigError naming the variable."""
    specs = []
    for entry in (part.strip() for part in text.split(",")):
        if entry:
            specs.append(_parse_fault(entry, text))
    return specs


def _parse_fault(entry: str, text: str) -> FaultSpec:
    def bad(why: str) -> ConfigError:
        return ConfigError(f"{FAULT_ENV}={text!r}: {why}; use POINT[:INDEX]@RANK[:ACTION], e.g. step:2@1 or step:2@1:kill")

    where, at, who = entry.partition("@")
    if not at or not where or not who:
        raise bad(f"{entry!r} has no @RANK")
    point, _, index = where.partition(":")
    rank, _, action = who.partition(":")
    action = action or "raise"
    if action not in FAULT_ACTIONS:
        raise bad(f"unknown action {action!r} (choose {', '.join(FAULT_ACTIONS)})")
    try:
        return FaultSpec(point, _wildcard_int(index), _wildcard_int(rank), action)
    except ValueError:
        raise bad(f"{entry!r} has a non-numeric index or rank") from None


def _wildcard_int(text: str) -> int | None:
    return None if text in ("", "*") else int(text)


def maybe_inject_fault(point: str, rank: int, index: int | None = None) -> None:
    """Test hook: fail here when H3_INJECT_FAULT names this point, index and rank (no-op when unset;
    the variable is parsed where it is set, a few times per step: no cache to outlive it)."""
    text = settings.injected_faults()
    if not text:
        return
    for spec in parse_fault_specs(text):
        if spec.matches(point, rank, index):
            _trigger(spec, point, rank, index, text)


def _trigger(spec: FaultSpec, point: str, rank: int, index: int | None, text: str) -> None:
    where = f"{point} {index}" if index is not None else point
    if spec.action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if spec.action == "exit":
        os._exit(3)
    if spec.action == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
        return
    message = f"injected fault at {where} on rank {rank} ({FAULT_ENV}={text})"
    if spec.action == "config":
        raise ConfigError(message)
    raise RuntimeError(message)
