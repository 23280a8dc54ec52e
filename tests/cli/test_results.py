"""Results are never mixed, lost or half-written: `h3 generate` and `h3 matrix` as users run them.

Most run in process through `main` (one rank, the tiny preset: a second or two each); the
concurrent run and the real Ctrl-C use a real `h3` process.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

import h3core.reports.outputs as outputs_module

from commands import h3_popen, one_line as _error


def _entries(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_a_rerun_into_a_folder_with_results_is_refused_or_replaces_it_whole(h3, tmp_path):
    run = tmp_path / "run"
    assert h3("generate", "--steps", "2", "--seed", "1", "-o", str(run))[0] == 0
    code, _, err = h3("generate", "--steps", "2", "--seed", "2", "--no-save-latents", "-o", str(run))
    assert code == 2 and "already holds files (latents.safetensors, preview.png, report.json, ...)" in _error(err) and "--overwrite" in err
    assert json.loads((run / "report.json").read_text())["seed"] == 1  # untouched
    assert h3("generate", "--steps", "2", "--seed", "2", "--no-save-latents", "--overwrite", "-o", str(run))[0] == 0
    assert _entries(run) == ["preview.png", "report.json", "video.mp4"]  # no stale latents of the first run beside the new report
    assert json.loads((run / "report.json").read_text())["seed"] == 2
    assert _entries(tmp_path) == ["run"]


@pytest.mark.parametrize(
    "args, needle",
    [
        (["-o", ""], "--output is empty (or '.')"),
        (["-o", "{tmp}/file"], "is a file, not a folder"),
        (["-o", "{tmp}/run", "--benchmark", "{tmp}/folder"], "is a folder; give a file path"),
    ],
)
def test_output_problems_are_found_before_any_rank_starts(h3, tmp_path, monkeypatch, args, needle):
    import h3core.generate.run as generate_run

    (tmp_path / "file").write_text("mine")
    (tmp_path / "folder").mkdir()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(generate_run, "execute", lambda *a, **k: pytest.fail("a rank started"))
    code, _, err = h3("generate", "--steps", "2", *(a.format(tmp=tmp_path) for a in args))
    assert code == 2 and needle in _error(err)
    assert _entries(tmp_path) == ["file", "folder"] and (tmp_path / "file").read_text() == "mine"


def test_a_full_disk_while_writing_is_one_line_and_leaves_nothing(h3, tmp_path, monkeypatch):
    real = outputs_module.write_atomic

    def full_at_the_report(path, data):
        if "report.json" in path.name:
            raise OSError(28, "No space left on device")  # ENOSPC after the latents were written
        real(path, data)

    monkeypatch.setattr(outputs_module, "write_atomic", full_at_the_report)
    code, _, err = h3("generate", "--steps", "2", "-o", str(tmp_path / "run"), "--benchmark", str(tmp_path / "bench.json"))
    assert code == 1 and "report.json: no space left on the device; nothing was written" in _error(err)
    assert _entries(tmp_path) == []  # no latents without a report, no benchmark copy, no staging


def test_ctrl_c_in_process_says_nothing_was_written(h3, tmp_path, monkeypatch):
    import h3core.generate.run as generate_run

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(generate_run, "build_report", interrupted)  # after every rank finished, before publishing
    code, _, err = h3("generate", "--steps", "2", "-o", str(tmp_path / "run"))
    assert code == 130 and _error(err) == "interrupted (Ctrl-C); nothing was written"
    assert _entries(tmp_path) == []


def test_an_interrupted_matrix_publishes_the_cells_it_finished(h3, tmp_path, monkeypatch):
    import h3core.matrix.run as matrix

    real, calls = matrix.execute, []

    def second_cell_interrupted(run, on_step=None):
        calls.append(run.request.world_size)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(run, on_step)

    monkeypatch.setattr(matrix, "execute", second_cell_interrupted)
    code, _, err = h3("matrix", "--counts", "1", "--steps", "2", "--no-save-latents", "-o", str(tmp_path / "m"))
    assert code == 130 and "interrupted (Ctrl-C) after 1 of 2 cells; what they measured is in" in _error(err)
    report = json.loads((tmp_path / "m" / "matrix.json").read_text())
    assert report["complete"] is False and [c["status"] for c in report["cells"]] == ["ok", "pending"]
    assert _entries(tmp_path) == ["m"] and "ulysses-1" in _entries(tmp_path / "m")


def _h3_process(*args: str, cache: str, **popen) -> subprocess.Popen:
    return h3_popen(*args, env={"H3_CACHE_DIR": cache}, **popen)


def _wait_for(condition, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def test_two_runs_into_one_folder_the_second_is_refused_at_once(h3, tmp_path, cache):
    run = tmp_path / "run"
    first = _h3_process("generate", "--steps", "20", "--seed", "1", "-o", str(run), cache=cache)
    try:
        _wait_for(lambda: any(tmp_path.glob(".run.h3-staging-*")), 120)  # the first run holds the folder ...
        os.kill(first.pid, signal.SIGSTOP)  # ... and keeps holding it while the second one tries
        start = time.monotonic()
        code, _, err = h3("generate", "--steps", "2", "--seed", "2", "-o", str(run))
        assert code == 2 and f"another h3 run (pid {first.pid}) is writing to {run} right now" in _error(err)
        assert time.monotonic() - start < 5
        assert not run.exists()  # the first run publishes only when it is done
    finally:
        os.kill(first.pid, signal.SIGCONT)
        _, first_err = first.communicate(timeout=300)
    assert first.returncode == 0, first_err
    assert _entries(run) == ["latents.safetensors", "preview.png", "report.json", "video.mp4"]
    assert json.loads((run / "report.json").read_text())["seed"] == 1
    assert _entries(tmp_path) == ["run"]


def test_a_real_ctrl_c_stops_every_rank_and_writes_nothing(tmp_path, cache):
    proc = _h3_process("generate", "--gpus", "2", "--steps", "100000", "-o", str(tmp_path / "run"), cache=cache, start_new_session=True)
    try:
        _wait_for(lambda: any(tmp_path.glob(".run.h3-staging-*")), 120)
        time.sleep(3)  # the ranks are up and denoising
        os.killpg(proc.pid, signal.SIGINT)  # what the terminal sends on Ctrl-C: every process of the group
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130 and _error(err) == "interrupted (Ctrl-C); nothing was written"
    assert _entries(tmp_path) == []
