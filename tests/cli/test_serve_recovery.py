"""A server killed with `kill -9` mid-job and started again finds every job (the finished one still
downloadable, the queued one run, the interrupted one run again from the start with its partial
files never served), and leaves no rank behind; a SIGTERM re-queues the running job, writes nothing
of it and exits 143. Real processes, two spawned Gloo ranks each."""

from __future__ import annotations

import signal
import sqlite3
import time
import uuid

from commands import ServerProcess, http, no_survivors, one_line


def _wait(check, seconds: float, what: str):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"{what} within {seconds}s")


def _job(server, job_id: str) -> dict:
    status, body, _ = http("GET", f"{server.url}/v1/videos/{job_id}")
    assert status == 200, body
    return body


def _create(server, **fields) -> str:
    status, body, _ = http("POST", f"{server.url}/v1/videos", {"size": "64x64", **fields})
    assert status == 200, body
    return body["id"]


def _rows(state) -> dict[str, dict]:
    with sqlite3.connect(state / "jobs.sqlite3") as db:
        db.row_factory = sqlite3.Row
        return {row["id"]: dict(row) for row in db.execute("SELECT * FROM jobs")}


def test_kill_9_mid_job_then_restart_finds_every_job_and_sigterm_requeues(tmp_path, cache):
    marker = f"H3_TEST_MARKER_{uuid.uuid4().hex}"
    state = tmp_path / "state"
    args = ("--gpus", "2", "--state-dir", str(state), "--width", "64", "--height", "64", "--frames", "22", "--steps", "3", "--max-steps", "5000")
    env = {"H3_CACHE_DIR": cache, marker: "1"}
    first = ServerProcess(*args, env=env)
    try:
        first.wait_ready()
        done = _create(first, prompt="a finished fox")
        _wait(lambda: _job(first, done)["status"] == "completed", 600, "the first job did not complete")
        interrupted = _create(first, prompt="an interrupted owl", steps=150)
        queued = _create(first, prompt="a queued cat")
        _wait(lambda: _job(first, interrupted)["progress"] > 0, 300, "the long job did not step")
        first.proc.kill()  # kill -9 the server alone: its ranks must notice and go
        first.proc.wait(timeout=30)
    finally:
        first.stop()
    assert no_survivors(marker, seconds=30)
    rows = _rows(state)
    assert rows[done]["status"] == "completed" and rows[interrupted]["status"] == "in_progress" and rows[queued]["status"] == "queued"

    second = ServerProcess(*args, env=env)
    try:
        second.wait_ready()
        status, body, _ = http("GET", f"{second.url}/v1/videos/{done}/content")
        assert status == 200 and body[4:8] == b"ftyp"  # the finished one: downloadable at once
        status, body, _ = http("GET", f"{second.url}/v1/videos/{interrupted}/content")
        assert status == 409 and body["error"]["code"] == "video_not_ready"  # nothing of the interrupted run is served
        for job_id in (interrupted, queued):
            finished = _wait(lambda: (j := _job(second, job_id))["status"] in ("completed", "failed") and j, 900, f"{job_id} did not finish")
            assert finished["status"] == "completed", finished
        assert _job(second, interrupted)["attempts"] == 2 and _job(second, queued)["attempts"] == 1
        assert http("GET", f"{second.url}/v1/videos/{interrupted}/content")[0] == 200
        print(f"\nafter kill -9 and a restart: {done} completed (kept), {interrupted} re-run (attempts 2) and completed, {queued} completed")

        running = _create(second, prompt="a job that SIGTERM re-queues", steps=5000)
        _wait(lambda: _job(second, running)["status"] == "in_progress", 120, "the long job did not start")
        time.sleep(1)
        code = second.signal(signal.SIGTERM)
        err = second.stderr()
    finally:
        second.stop()
    assert code == 143, err
    assert one_line(err).startswith("interrupted (SIGTERM); 1 running job(s) re-queued, nothing of them written"), err
    assert _rows(state)[running]["status"] == "queued"
    assert not list((state / "jobs").glob(".*staging*")) and not (state / "jobs" / running).exists()
    assert no_survivors(marker)


def test_ctrl_c_stops_a_server_with_exit_130_and_releases_its_state_dir(tmp_path, cache):
    state = tmp_path / "state"
    args = ("--state-dir", str(state), "--width", "64", "--height", "64", "--frames", "22", "--steps", "3")
    server = ServerProcess(*args, env={"H3_CACHE_DIR": cache})
    try:
        server.wait_ready()
        code = server.signal(signal.SIGINT)
        err = server.stderr()
    finally:
        server.stop()
    assert code == 130 and one_line(err).startswith("interrupted (Ctrl-C); no job was running"), err
    again = ServerProcess(*args, env={"H3_CACHE_DIR": cache})  # the lock went with it: the same directory serves again
    try:
        again.wait_ready()
    finally:
        again.stop()
