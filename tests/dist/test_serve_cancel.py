"""A serving job stopped at a step boundary (`h3core.generate.control`): every rank of its group stops
at the same step, whenever the flag is set (the lead's reading, broadcast over the group: a flag each
rank read on its own would part the group's collectives); the World stays usable; another replica
group's job of the same round goes on, bit for bit as if nothing happened. Two spawned Gloo ranks."""

from __future__ import annotations

import random
import threading

import pytest
import torch

from h3core.generate.control import Board, JobControl, Stopped
from h3core.batch.run import run_round
from h3core.generate.request import GenerateRequest, resolve
from h3core.generate.resident import encode_prompts_once
from h3core.runtime.world import World

STEPS = 40


@pytest.fixture(scope="module")
def world2():
    with World(2, "cpu", timeout_s=120) as world:
        yield world


def _run(replicas: int, seed: int, steps: int = STEPS):  # 64x64, 22 frames: a few ms a step
    return resolve(GenerateRequest(prompt=f"a fox {seed}", preset="tiny", width=64, height=64, frames=22, steps=steps, seed=seed,
                                   world_size=2, replicas=replicas, device="cpu"))


def _round(world, runs, controls):
    texts = world.run(encode_prompts_once, [r for r in runs if r is not None], True)[0]
    return run_round(world, runs, texts, [i if r is not None else None for i, r in enumerate(runs)], controls)


def test_a_flag_set_at_any_moment_stops_both_ranks_at_the_same_step(world2):
    run, board, rng = _run(1, 3), Board(world2.store), random.Random(7)
    stopped_at = []
    for attempt in range(4):
        control = JobControl(key=f"job{attempt}")
        timer = threading.Timer(rng.uniform(0.0, 1.5), board.cancel, args=(control,))  # while the ranks step
        timer.start()
        try:
            (outcomes,) = _round(world2, [run], [control])
        finally:
            timer.cancel()
            board.forget(control)
        kinds = {type(o) for o in outcomes}
        assert len(kinds) == 1, outcomes  # both ranks stopped, or both finished: never one of each
        if isinstance(outcomes[0], Stopped):
            assert outcomes[0].step == outcomes[1].step and 0 <= outcomes[0].step < STEPS - 1
            stopped_at.append(outcomes[0].step)
    control = JobControl(key="set-before")
    board.cancel(control)
    (outcomes,) = _round(world2, [run], [control])
    assert [o.step for o in outcomes] == [0, 0]  # the first boundary: no step ran
    board.forget(control)
    assert not world2.closed  # no fault: the World took every round
    print(f"stopped at steps {stopped_at} of {STEPS - 1}")


def test_the_world_runs_the_next_job_alike_after_a_stop(world2):
    run = _run(1, 5)
    (reference,) = _round(world2, [run], None)  # no control: no gate, as `h3 generate --prompts` runs
    control = JobControl(key="stop-now")
    Board(world2.store).cancel(control)
    assert isinstance(_round(world2, [run], [control])[0][0], Stopped)
    (again,) = _round(world2, [run], [JobControl(key="runs-through")])  # a gate that never stops
    assert all(torch.equal(again[0].latents[k], reference[0].latents[k]) for k in reference[0].latents)


def test_stopping_one_replica_groups_job_leaves_the_others_alone(world2):
    runs = [_run(2, 11), _run(2, 12)]
    alone = _round(world2, [runs[1], None], None)[0]  # replica 0 runs seed 12 alone: the reference
    board, controls = Board(world2.store), [JobControl(key="cancelled"), JobControl(key="kept")]
    board.cancel(controls[0])
    first, second = _round(world2, runs, controls)
    assert isinstance(first[0], Stopped) and first[0].step == 0
    assert all(torch.equal(second[0].latents[k], alone[0].latents[k]) for k in alone[0].latents)
    for control in controls:
        board.forget(control)
