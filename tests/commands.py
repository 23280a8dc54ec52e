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


def fresh_python(code: str, timeout: float = 300) -> str:
    """The stdout of `python -c CODE` in a fresh interpreter (what imports it makes, or what it measures,
    is its own), checked to exit 0."""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


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


SERVE_KEY = "test-key-0123456789abcdef"
"""The API key of the cli tier's shared server (`served` in tests/cli/conftest.py)."""


class ServerProcess:
    """`h3 serve ARGS... --port 0` as a real process (its own process group), its address read from
    the first line it prints; `wait_ready` polls /health. Stop it with `signal` (the test's) or `kill`."""

    def __init__(self, *args: str, env: dict[str, str] | None = None):
        import tempfile

        self.log = tempfile.TemporaryFile(mode="w+")
        full = {k: v for k, v in os.environ.items() if k != "H3_DEBUG"} | {"COLUMNS": "300"} | (env or {})
        self.proc = subprocess.Popen([sys.executable, "-m", "h3cli.main", "serve", "--port", "0", *args], stdout=subprocess.PIPE,
                                     stderr=self.log, text=True, env=full, start_new_session=True)
        first = self.proc.stdout.readline() if self.proc.stdout else ""
        if "http://" not in first:
            self.proc.wait(timeout=30)
            raise AssertionError(f"h3 serve did not start: {first!r} {self.stderr()}")
        self.base = first.split("http://", 1)[1].split("/", 1)[0]
        self.url = f"http://{self.base}"

    def stderr(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def wait_ready(self, seconds: float = 240) -> None:
        import json
        import urllib.error
        import urllib.request

        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.stderr()
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as response:
                    if json.load(response)["status"] == "ok":
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.3)
        raise AssertionError(f"h3 serve was not ready within {seconds}s: {self.stderr()}")

    def signal(self, signum: int, timeout: float = 120) -> int:
        """Send `signum` to the server's process group; its exit code."""
        import signal as signals

        os.killpg(self.proc.pid, signum)
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signals.SIGKILL)
                self.proc.wait()

    def stop(self) -> None:
        import signal as signals

        if self.proc.poll() is None:
            self.signal(signals.SIGTERM)
        if self.proc.stdout:
            self.proc.stdout.close()
        self.log.close()


def http(method: str, url: str, body: dict | None = None, headers: dict[str, str] | None = None) -> tuple[int, dict | bytes, dict[str, str]]:
    """One request with the standard library: (status, JSON body or bytes, headers)."""
    import json
    import urllib.error
    import urllib.request

    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, method=method, headers={**({"content-type": "application/json"} if data else {}), **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            status, raw, got = response.status, response.read(), dict(response.headers)
    except urllib.error.HTTPError as err:
        status, raw, got = err.code, err.read(), dict(err.headers)
    kind = got.get("content-type", got.get("Content-Type", ""))
    return status, (json.loads(raw) if "json" in kind else raw), got
