"""SIGTERM (what `timeout`, docker, SLURM and systemd send) is handled exactly like Ctrl-C, with exit
143: nothing half-written, staging folders and lock entries removed, a matrix's finished cells and a
batch's finished prompts kept, every rank stopped. In process, a real SIGTERM to this process at
the moment a test picks; and one real `h3` process stopped by a SIGTERM to its process group."""

from __future__ import annotations

import json
import os
import signal
import time
import uuid
from pathlib import Path

from commands import h3_popen, no_survivors, one_line


def _entries(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def _sigterm(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(5)  # the handler raises long before this ends
    raise AssertionError("SIGTERM was not handled")


def test_sigterm_in_a_run_says_nothing_was_written_and_exits_143(h3, tmp_path, monkeypatch):
    import h3core.generate.run as generate_run

    monkeypatch.setattr(generate_run, "build_report", _sigterm)  # after every rank finished, before publishing
    code, _, err = h3("generate", "--steps", "2", "-o", str(tmp_path / "run"))
    assert code == 143 and one_line(err) == "interrupted (SIGTERM); nothing was written"
    assert _entries(tmp_path) == []  # no staging folder, no lock entry


def test_sigterm_in_a_matrix_keeps_the_finished_cells_as_ctrl_c_does(h3, tmp_path, monkeypatch):
    import h3core.matrix.run as matrix

    real, calls = matrix.execute, []

    def second_cell_terminated(run, on_step=None):
        calls.append(run.request.world_size)
        if len(calls) == 2:
            _sigterm()
        return real(run, on_step)

    monkeypatch.setattr(matrix, "execute", second_cell_terminated)
    code, _, err = h3("matrix", "--counts", "1", "--steps", "2", "--no-save-latents", "-o", str(tmp_path / "m"))
    assert code == 143 and "interrupted (SIGTERM) after 1 of 2 cells; what they measured is in" in one_line(err)
    report = json.loads((tmp_path / "m" / "matrix.json").read_text())
    assert report["complete"] is False and [c["status"] for c in report["cells"]] == ["ok", "pending"]
    assert _entries(tmp_path) == ["m"]  # published in place: not a hidden staging folder the next run deletes


def test_sigterm_in_a_batch_keeps_the_finished_prompts_as_ctrl_c_does(h3, tmp_path, monkeypatch):
    import h3core.batch.run as batch_run

    prompts = tmp_path / "p.txt"
    prompts.write_text("a red fox in snow\nan owl at night\n")
    real, calls = batch_run.run_round, []

    def second_terminated(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            _sigterm()
        return real(*args, **kwargs)

    monkeypatch.setattr(batch_run, "run_round", second_terminated)
    code, _, err = h3("generate", "--prompts", str(prompts), "--steps", "2", "-o", str(tmp_path / "b"))
    assert code == 143 and "interrupted (SIGTERM) after 1 of 2 prompts" in one_line(err)
    summary = json.loads((tmp_path / "b" / "batch.json").read_text())
    assert summary["stopped"] == "interrupted (SIGTERM)" and [p["status"] for p in summary["prompts"]] == ["ok", "pending"]
    assert _entries(tmp_path) == ["b", "p.txt"] and _entries(tmp_path / "b") == ["000-a-red-fox-in-snow", "batch.json"]


def test_the_handler_is_only_installed_while_a_command_runs(h3, tmp_path):
    before = signal.getsignal(signal.SIGTERM)
    assert h3("plan", "2", "--preset", "tiny")[0] == 0
    assert signal.getsignal(signal.SIGTERM) == before


def test_a_real_sigterm_to_the_process_group_stops_every_rank_and_writes_nothing(tmp_path, cache):
    marker = f"H3_TEST_MARKER_{uuid.uuid4().hex}"
    proc = h3_popen("generate", "--gpus", "2", "--steps", "100000", "-o", str(tmp_path / "run"),
                    env={"H3_CACHE_DIR": cache, marker: "1"}, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not any(tmp_path.glob(".run.h3-staging-*")):
            assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
            time.sleep(0.1)
        time.sleep(3)  # the ranks are up and denoising
        os.killpg(proc.pid, signal.SIGTERM)  # systemd, SLURM: every process of the group
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 143 and one_line(err) == "interrupted (SIGTERM); nothing was written"
    assert _entries(tmp_path) == []
    assert no_survivors(marker)
