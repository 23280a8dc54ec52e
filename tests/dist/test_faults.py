"""Faults: a rank that raises or dies ends the run promptly, with its error, and no worker survives.

Each test needs its own World: after a fault the World is closed by design.
"""

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from h3core.errors import ConfigError, RankFailure
from h3core.runtime.faults import FAULT_ENV, maybe_inject_fault
from h3core.runtime.world import World

PROMPT_S = 15  # "within seconds", with room for a loaded 2-core machine


def _steps(ctx, steps):
    """A denoising-loop stand-in: the fault hook, then a collective every rank must join."""
    total = torch.zeros(1)
    for step in range(steps):
        maybe_inject_fault("step", ctx.rank, step)
        value = torch.ones(1)
        dist.all_reduce(value, group=ctx.group)
        total += value
    return total


def _raise_on(ctx, bad_rank):
    if ctx.rank == bad_rank:
        raise ValueError(f"boom from rank {ctx.rank}")
    dist.barrier(group=ctx.group)  # the others wait for the rank that will never come


def _rank(ctx):
    return ctx.rank


def _no_survivors(pids):
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def _failing_world(monkeypatch, fault):
    monkeypatch.setenv(FAULT_ENV, fault)  # inherited by the workers at spawn
    return World(2, "cpu", timeout_s=60)


def test_rank_raising_reports_its_message_and_reaps_everyone():
    with World(2, "cpu", timeout_s=60) as world:
        pids = world.pids
        assert world.run(_rank) == [0, 1]  # the World works before the fault ...
        with pytest.raises(TypeError, match="module-level"):
            world.run(lambda ctx: 0)  # ... an unsendable task is refused without hurting it ...
        assert world.run(_rank) == [0, 1]
        start = time.monotonic()
        with pytest.raises(RankFailure) as err:
            world.run(_raise_on, 1)
        assert time.monotonic() - start < PROMPT_S
        assert err.value.rank == 1
        assert str(err.value) == "rank 1 failed: ValueError: boom from rank 1"
        assert "Traceback" in str(err.value.__cause__)  # the rank's traceback, for H3_DEBUG=1
        assert world.closed
        _no_survivors(pids)
        with pytest.raises(RuntimeError, match="closed"):
            world.run(_rank)


def test_injected_fault_mid_loop(monkeypatch):
    with _failing_world(monkeypatch, "step:2@1") as world:
        pids = world.pids
        with pytest.raises(RankFailure, match=r"rank 1 failed: RuntimeError: injected fault at step 2 on rank 1"):
            world.run(_steps, 4)
    _no_survivors(pids)


@pytest.mark.parametrize(
    "fault, message",
    [("step:1@1:kill", "rank 1 failed: process killed by signal SIGKILL"), ("step:1@0:exit", "rank 0 failed: process exited with code 3")],
)
def test_dead_rank_is_reported_not_its_peers_errors(monkeypatch, fault, message):
    with _failing_world(monkeypatch, fault) as world:
        pids = world.pids
        start = time.monotonic()
        with pytest.raises(RankFailure) as err:
            world.run(_steps, 4)
        assert time.monotonic() - start < PROMPT_S
        assert str(err.value) == message
    _no_survivors(pids)


def test_config_error_in_a_rank_keeps_exit_code_2(monkeypatch):
    with _failing_world(monkeypatch, "step:0@1:config") as world:
        pids = world.pids
        with pytest.raises(ConfigError) as err:
            world.run(_steps, 2)
    assert err.value.exit_code == 2
    assert str(err.value).startswith("rank 1: injected fault at step 0")
    _no_survivors(pids)


def test_worker_killed_between_tasks_is_noticed():
    with World(2, "cpu", timeout_s=60) as world:
        pids = world.pids
        os.kill(pids[1], signal.SIGKILL)
        time.sleep(0.2)
        with pytest.raises(RankFailure, match="rank 1 failed: process killed by signal SIGKILL"):
            world.run(_rank)
    _no_survivors(pids)


def test_leaving_the_block_on_an_exception_reaps_every_worker():
    with pytest.raises(KeyboardInterrupt):
        with World(2, "cpu", timeout_s=60) as world:
            pids = world.pids
            raise KeyboardInterrupt
    _no_survivors(pids)
