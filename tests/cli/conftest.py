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
