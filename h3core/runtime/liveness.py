"""Signs of life of spawned ranks: the heartbeat each worker stamps, and the watch its parent keeps.

A worker runs `beat_while_parent_lives` in a thread of its own: every second it stamps
`time.monotonic()` (CLOCK_MONOTONIC: one clock for every process of the machine) into a double
shared with the parent, and it exits when its parent is gone. A process that stops running
(`kill -STOP`, frozen, swapped out) stops stamping; a process that runs but waits (a collective
whose peer is stuck) keeps stamping, so the silent rank is the one that is named.

`Watch.silent` is the parent's side: called often, it looks once a second and reports the first
started rank silent for longer than its timeout, with the process state /proc gives. When the
parent itself did not run for a while (Ctrl-Z then `fg`, a suspended machine), the ranks were
not running either: their silence is counted from when the parent woke up.
"""

from __future__ import annotations

import os
import time
from typing import Any

HEARTBEAT_S = 1.0
_ASLEEP_S = 5 * HEARTBEAT_S  # a gap this long between two looks means this process was not running

_STATES = {
    "T": "process stopped (SIGSTOP or a debugger)",
    "t": "process stopped by a debugger",
    "D": "process blocked in I/O",
    "Z": "process exited",
    "R": "process running but not answering",
    "S": "process sleeping",
}


def new_heartbeat(context: Any) -> Any:
    """A double in shared memory (one writer: no lock) holding a worker's last stamp."""
    return context.Value("d", time.monotonic(), lock=False)


def beat_while_parent_lives(parent_pid: int, heartbeat: Any) -> None:
    """Worker thread: stamp `heartbeat` every second; end the process when the parent is gone."""
    while os.getppid() == parent_pid:
        heartbeat.value = time.monotonic()
        time.sleep(HEARTBEAT_S)
    os._exit(1)


def process_state(pid: int | None) -> str:
    """A process's scheduler state from /proc, in words ('process stopped (SIGSTOP ...)', ...)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "process state unknown"
    return _STATES.get(state, f"process state {state}")


class Watch:
    """Which started rank has shown no sign of life for longer than `timeout_s`."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self.started = False  # set once every rank has joined (before, importing torch may starve the thread)
        self._last_look = self._last_check = self._awake_since = time.monotonic()

    def silent(self, beats: dict[int, tuple[int | None, Any]]) -> tuple[int, str] | None:
        """`beats`: rank -> (pid, heartbeat) of the living workers. (rank, what happened) or None."""
        now = time.monotonic()
        if now - self._last_look > _ASLEEP_S:
            self._awake_since = now
        self._last_look = now
        if not self.started or now - self._last_check < HEARTBEAT_S:
            return None
        self._last_check = now
        for rank, (pid, heartbeat) in sorted(beats.items()):
            silent = now - max(heartbeat.value, self._awake_since)
            if silent > self.timeout_s:
                return rank, f"no sign of life for {silent:.0f} s ({process_state(pid)})"
        return None
