"""The distributed environment: one definition of "launched by torchrun", a stale torchrun environment
is one line in bounded time, and a stopped rank ends the run with a clear line."""

from __future__ import annotations

import json
import socket
import subprocess
import time
import uuid

import pytest

from commands import h3_process, no_survivors, one_line as _one_line

TORCHRUN = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def _process(*args: str, env: dict[str, str], timeout: float = 120) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    clean = {name: "" for name in TORCHRUN}  # unset: an empty value counts as not set
    proc = h3_process(*args, env={**clean, **env}, timeout=timeout)
    return proc, time.monotonic() - start


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_a_stray_rank_variable_does_not_silence_json(h3, tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "1")  # no WORLD_SIZE or LOCAL_RANK: not a torchrun launch
    code, out, err = h3("generate", "--steps", "2", "--json", "-o", str(tmp_path / "run"))
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
    code, out, err = h3("generate", "--steps", "2", "--json", "-o", str(tmp_path / "run"))
    line = _one_line(err)
    assert code == 2 and needle in line and "unset RANK, WORLD_SIZE and LOCAL_RANK" in line
    assert out == "" and not (tmp_path / "run").exists()


@pytest.mark.parametrize("rank", ["0", "1"])  # rank 0 waits for peers to join its store; rank 1 for a store to answer
def test_a_stale_torchrun_environment_ends_in_one_line_in_bounded_time(tmp_path, cache, rank):
    env = {"RANK": rank, "WORLD_SIZE": "2", "LOCAL_RANK": rank, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
           "H3_RANK_TIMEOUT": "2", "H3_CACHE_DIR": cache}
    proc, seconds = _process("generate", "--steps", "2", "-o", str(tmp_path / "run"), env=env)
    line = _one_line(proc.stderr)  # no C++ stack traces from the store's retries either
    assert proc.returncode == 2 and "the 2 torchrun ranks did not meet within 2 s" in line and "H3_RANK_TIMEOUT" in line
    assert seconds < 30 and not (tmp_path / "run").exists()


def test_a_stopped_rank_ends_the_run_with_a_clear_line_in_bounded_time(h3, tmp_path, monkeypatch):
    marker = f"H3_TEST_MARKER_{uuid.uuid4().hex}"
    for name, value in {"H3_INJECT_FAULT": "step:1@1:stop", "H3_RANK_TIMEOUT": "3", marker: "1"}.items():
        monkeypatch.setenv(name, value)  # the spawned ranks inherit them
    start = time.monotonic()
    code, _, err = h3("generate", "tensor", "2", "--steps", "3", "-o", str(tmp_path / "run"))
    line = _one_line(err)
    assert code == 1 and line.startswith("error: rank 1 failed: no sign of life for")
    assert "process stopped (SIGSTOP or a debugger)" in line and "H3_RANK_TIMEOUT (now 3 s)" in line
    assert time.monotonic() - start < 60 and not (tmp_path / "run").exists()
    assert no_survivors(marker)
