"""The cli tier: `h3` as a user runs it. Most tests run it in this process (`h3` fixture: exit code,
stdout, stderr); the few that need a real process use `commands.h3_process`."""

from __future__ import annotations

import pytest

from commands import run_main

TORCHRUN = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(scope="session")
def cache(tmp_path_factory) -> str:
    """One synthetic-checkpoint cache for the whole tier (each preset's checkpoint is built once)."""
    return str(tmp_path_factory.mktemp("cache"))


@pytest.fixture
def h3(capsys, monkeypatch, cache):
    """`h3 ARGS...` in this process: (exit code, stdout, stderr); wide columns, no H3_DEBUG, no torchrun variables."""
    monkeypatch.setenv("COLUMNS", "300")
    monkeypatch.setenv("H3_CACHE_DIR", cache)
    monkeypatch.delenv("H3_DEBUG", raising=False)
    for name in TORCHRUN:
        monkeypatch.delenv(name, raising=False)
    return lambda *args: run_main(capsys, *args)


@pytest.fixture(scope="session")
def served(tmp_path_factory, cache):
    """One `h3 serve` process for the tier's API, client and page tests: synthetic tiny model, small
    clips (64x64, 22 frames, 3 sigma points), an API key, one allowed directory (`served.allowed`), requests of
    up to 5000 steps (long jobs to cancel)."""
    from commands import SERVE_KEY, ServerProcess

    root = tmp_path_factory.mktemp("served")
    allowed = root / "allowed"
    allowed.mkdir()
    server = ServerProcess("--state-dir", str(root / "state"), "--width", "64", "--height", "64", "--frames", "22", "--steps", "3",
                           "--api-key", SERVE_KEY, "--allow-path", str(allowed), "--max-body-mb", "2", "--max-queue", "8", "--max-steps", "5000",
                           env={"H3_CACHE_DIR": cache, "OMP_NUM_THREADS": "1"})
    server.allowed, server.state = allowed, root / "state"
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()
