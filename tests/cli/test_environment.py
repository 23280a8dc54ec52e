"""The distributed environment: one definition of "launched by torchrun", a stale torchrun environment
is one line in bounded time, and a stopped rank ends the run with a clear line."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from h3cli.main import main

TORCHRUN = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("cache"))


@pytest.fixture
def h3(capsys, monkeypatch, cache):
    monkeypatch.setenv("H3_CACHE_DIR", cache)
    monkeypatch.delenv("H3_DEBUG", raising=False)
    for name in TORCHRUN:
        monkeypatch.delenv(name, raising=False)

    def run(*args: str) -> tuple[int, str, str]:
        capsys.readouterr()
        try:
            main(list(args))
            code = 0
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else 1
        out, err = capsys.readouterr()
        return code, out, err

    return run


def _process(*args: str, env: dict[str, str], timeout: float = 120) -> tuple[subprocess.CompletedProcess, float]:
    full = {k: v for k, v in os.environ.items() if k not in TORCHRUN and k != "H3_DEBUG"}
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "h3cli.main", *args], capture_output=True, text=True, env={**full, **env}, timeout=timeout)
    return proc, time.monotonic() - start


def _one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_a_stray_rank_variable_does_not_silence_json(h3, tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "1")  # no WORLD_SIZE or LOCAL_RANK: not a torchrun launch
    code, out, err = h3("generate", "--steps", "1", "--json", "-o", str(tmp_path / "run"))
    assert code == 0, err
    assert json.loads(out)["world_size"] == 1 and (tmp_path / "run" / "report.json").exists()


@pytest.mark.parametrize(
    "env, needle",
    [
        ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}, "says torchrun started h3, but MASTER_ADDR and MASTER_PORT are not set"),
        ({"RANK": "x", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}, "RANK=x WORLD_SIZE=2 LOCAL_RANK=0: not whole numbers"),
        ({"RANK": "3", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}, "not a valid torchrun rank (needs 0 <= RANK < WORLD_SIZE)"),
    ],
)
def test_a_malformed_torchrun_environment_is_one_line(h3, tmp_path, monkeypatch, env, needle):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    code, out, err = h3("generate", "--steps", "1", "--json", "-o", str(tmp_path / "run"))
    line = _one_line(err)
    assert code == 2 and needle in line and "unset RANK, WORLD_SIZE and LOCAL_RANK" in line
    assert out == "" and not (tmp_path / "run").exists()


@pytest.mark.parametrize("rank", ["0", "1"])  # rank 0 waits for peers to join its store; rank 1 for a store to answer
def test_a_stale_torchrun_environment_ends_in_one_line_in_bounded_time(tmp_path, cache, rank):
    env = {"RANK": rank, "WORLD_SIZE": "2", "LOCAL_RANK": rank, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
           "H3_RANK_TIMEOUT": "2", "H3_CACHE_DIR": cache}
    proc, seconds = _process("generate", "--steps", "1", "-o", str(tmp_path / "run"), env=env)
    line = _one_line(proc.stderr)  # no C++ stack traces from the store's retries either
    assert proc.returncode == 2 and "the 2 torchrun ranks did not meet within 2 s" in line and "H3_RANK_TIMEOUT" in line
    assert seconds < 30 and not (tmp_path / "run").exists()


def _survivors(marker: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker.encode() in (entry / "environ").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def test_a_stopped_rank_ends_the_run_with_a_clear_line_in_bounded_time(tmp_path, cache):
    marker = f"H3_TEST_MARKER_{uuid.uuid4().hex}"
    env = {"H3_INJECT_FAULT": "step:1@1:stop", "H3_RANK_TIMEOUT": "3", "H3_CACHE_DIR": cache, marker: "1"}
    proc, seconds = _process("generate", "tensor", "2", "--steps", "3", "-o", str(tmp_path / "run"), env=env)
    line = _one_line(proc.stderr)
    assert proc.returncode == 1 and line.startswith("error: rank 1 failed: no sign of life for")
    assert "process stopped (SIGSTOP or a debugger)" in line and "H3_RANK_TIMEOUT (now 3 s)" in line
    assert seconds < 60 and not (tmp_path / "run").exists()
    deadline = time.monotonic() + 10
    while _survivors(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _survivors(marker) == []
