"""Running `h3` in tests, one way each: in this process (`run_main`, what most command tests use) or
as a real process (`h3_process`, only for what needs one: exit codes and signals of a real process,
no surviving workers after it exits, torchrun); and the checks command tests share."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from h3cli.main import main

REPO = Path(__file__).resolve().parents[1]


def run_main(capsys, *args: str) -> tuple[int, str, str]:
    """`h3 ARGS...` in this process: (exit code, stdout, stderr)."""
    capsys.readouterr()
    try:
        main(list(args))
        code = 0
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 1
    out, err = capsys.readouterr()
    return code, out, err


def h3_process(*args: str, env: dict[str, str] | None = None, timeout: float = 300, **popen) -> subprocess.CompletedProcess:
    """`h3 ARGS...` as a real process, with this environment (less H3_DEBUG) plus `env`."""
    full = {k: v for k, v in os.environ.items() if k != "H3_DEBUG"}
    return subprocess.run([sys.executable, "-m", "h3cli.main", *args], capture_output=True, text=True, env={**full, **(env or {})}, timeout=timeout, **popen)


def h3_popen(*args: str, env: dict[str, str] | None = None, **popen) -> subprocess.Popen:
    """`h3 ARGS...` started as a real process and left running (pipes for stdout and stderr)."""
    full = {k: v for k, v in os.environ.items() if k != "H3_DEBUG"}
    return subprocess.Popen([sys.executable, "-m", "h3cli.main", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**full, **(env or {})}, **popen)


def one_line(err: str) -> str:
    """The single line an error prints (no traceback), checked."""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def survivors(marker: str) -> list[int]:
    """Processes whose environment carries `marker` (the workers of a run that should be gone), not
    counting this test process's own multiprocessing resource tracker (started with the marker set
    when a run is made in this process; it belongs to pytest, and ends with it)."""
    found, ours = [], _own_helpers()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) not in ours:
            try:
                if marker.encode() in (entry / "environ").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def _own_helpers() -> set[int]:
    from multiprocessing import resource_tracker

    pid = getattr(resource_tracker._resource_tracker, "_pid", None)  # private; None when none was started
    return {os.getpid()} | ({pid} if pid else set())


def no_survivors(marker: str, seconds: float = 10) -> bool:
    """True once no process carries `marker`, waiting up to `seconds` for the reaped ones to vanish."""
    deadline = time.monotonic() + seconds
    while survivors(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    return survivors(marker) == []
