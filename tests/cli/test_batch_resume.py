"""`h3 generate --prompts` cannot trust stale work, and stops when its folder can no longer take results:

- resume fingerprints what decides a result (the weights by content, H3_EMULATE_FP4) and matches
  prompts by content, not position; the folder of another batch is refused unless --overwrite;
- a disk that cannot hold the next prompt's results stops the batch before it is computed
  (a real 2 MiB tmpfs where this runs as root, and an injected ENOSPC everywhere);
- a batch folder deleted or replaced while the batch runs is a failure, never made again silently.

In process, one rank, the tiny preset, one step: a second or two per prompt.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

import h3core.batch.run as batch_run
from commands import one_line
from h3core.batch.report import BatchReport


def _write(path: Path, prompts: list[str]) -> Path:
    path.write_text("".join(p + "\n" for p in prompts))
    return path


def _batch(h3, prompts: Path, out: Path, *extra: str):
    code, stdout, err = h3("generate", "--prompts", str(prompts), "--steps", "2", "--output", str(out), "--json", *extra)
    return code, (BatchReport.model_validate_json(stdout) if stdout.strip() else None), err


def _statuses(report: BatchReport) -> list[str]:
    return [p.status.value for p in report.prompts]


def _listed(report: BatchReport) -> set[str]:
    return {p.folder for p in report.prompts} | set(report.other_folders)


def _subfolders(out: Path) -> set[str]:
    return {p.name for p in out.iterdir() if p.is_dir()}


# --- resume: what decides a result, matched by content ---------------------------------------------------


@pytest.fixture
def two_weights(tmp_path):
    """Two synthetic tiny checkpoints with other weights (seeds 0 and 1), and `m.safetensors`, a copy of the first."""
    from h3core.model.config import preset
    from h3core.model.synthetic import synthetic_checkpoint

    first, _ = synthetic_checkpoint(preset("tiny"), seed=0, directory=tmp_path / "w0")
    other, _ = synthetic_checkpoint(preset("tiny"), seed=1, directory=tmp_path / "w1")
    model = tmp_path / "m.safetensors"
    shutil.copyfile(first, model)
    return model, other


def test_replaced_weights_redo_every_prompt(h3, tmp_path, two_weights):
    model, other = two_weights
    prompts, out = _write(tmp_path / "p.txt", ["a red fox", "an owl"]), tmp_path / "b"
    flags = ("--model", str(model), "--preset", "tiny")
    code, first, err = _batch(h3, prompts, out, *flags)
    assert code == 0 and _statuses(first) == ["ok", "ok"], err
    code, again, _ = _batch(h3, prompts, out, *flags)
    assert _statuses(again) == ["skipped", "skipped"]
    shutil.copyfile(other, model)  # other weights under the same path (same size, same header)
    code, redone, err = _batch(h3, prompts, out, *flags)
    assert code == 0 and _statuses(redone) == ["ok", "ok"], err
    assert [p.fingerprint for p in redone.prompts] != [p.fingerprint for p in first.prompts]


def test_a_setting_that_changes_numbers_redoes_every_prompt(h3, tmp_path, monkeypatch):
    prompts, out = _write(tmp_path / "p.txt", ["a red fox", "an owl"]), tmp_path / "b"
    assert _statuses(_batch(h3, prompts, out)[1]) == ["ok", "ok"]
    monkeypatch.setenv("H3_EMULATE_FP4", "1")
    code, redone, err = _batch(h3, prompts, out)
    assert code == 0 and _statuses(redone) == ["ok", "ok"], err
    assert _statuses(_batch(h3, prompts, out)[1]) == ["skipped", "skipped"]  # the same setting again: done


def test_prompts_are_matched_by_content_not_position(h3, tmp_path):
    prompts, out = _write(tmp_path / "p.txt", ["a red fox", "an owl", "a cat"]), tmp_path / "b"
    code, first, _ = _batch(h3, prompts, out)
    assert code == 0
    _write(prompts, ["a lighthouse", "a red fox", "an owl", "a cat"])  # a line inserted at the top
    code, again, err = _batch(h3, prompts, out)
    assert code == 0 and _statuses(again) == ["ok", "skipped", "skipped", "skipped"], err
    assert [p.folder for p in again.prompts][1:] == [p.folder for p in first.prompts]  # each keeps its result's folder
    assert again.prompts[0].folder == "000-a-lighthouse"
    assert _subfolders(out) == _listed(again) and again.other_folders == []  # every folder is listed
    _write(prompts, ["a cat", "a red fox"])  # reordered, two dropped
    code, third, _ = _batch(h3, prompts, out)
    assert _statuses(third) == ["skipped", "skipped"] and sorted(third.other_folders) == ["000-a-lighthouse", "001-an-owl"]
    assert _subfolders(out) == _listed(third)


def test_a_new_prompt_never_takes_the_folder_of_a_kept_result(h3, tmp_path):
    prompts, out = _write(tmp_path / "p.jsonl", ['{"prompt": "a fox", "seed": 1}']), tmp_path / "b"
    assert _batch(h3, prompts, out)[0] == 0
    _write(prompts, ['{"prompt": "a fox", "seed": 2}', '{"prompt": "a fox", "seed": 1}'])  # the same slug, another seed, first
    code, again, err = _batch(h3, prompts, out)
    assert code == 0 and _statuses(again) == ["ok", "skipped"], err
    assert [p.folder for p in again.prompts] == ["000-a-fox-2", "000-a-fox"]
    seeds = {name: json.loads((out / name / "report.json").read_text())["seed"] for name in ("000-a-fox", "000-a-fox-2")}
    assert seeds == {"000-a-fox": 1, "000-a-fox-2": 2}


def test_the_folder_of_another_batch_is_refused_unless_overwrite(h3, tmp_path):
    out = tmp_path / "b"
    assert _batch(h3, _write(tmp_path / "p.txt", ["a red fox"]), out)[0] == 0
    other = _write(tmp_path / "q.txt", ["an owl"])
    for prompts, extra in ((other, ()), (tmp_path / "p.txt", ("--seed", "9"))):  # another file; other flags
        code, _, err = _batch(h3, prompts, out, *extra)
        assert code == 2 and "holds the batch of --prompts" in one_line(err) and "--overwrite" in err
    assert _subfolders(out) == {"000-a-red-fox"}  # untouched
    code, replaced, err = _batch(h3, other, out, "--overwrite")
    assert code == 0 and _statuses(replaced) == ["ok"], err
    assert _subfolders(out) == {"000-an-owl"} and not replaced.resumed  # replaced whole


def test_a_batch_json_that_is_not_this_batchs_is_refused(h3, tmp_path):
    out = tmp_path / "b"
    out.mkdir()
    (out / "batch.json").write_text('{"command": "generate --prompts", "prompts": []}')  # no batch fingerprint
    code, _, err = _batch(h3, _write(tmp_path / "p.txt", ["a red fox"]), out)
    assert code == 2 and "cannot take as this batch's" in one_line(err)


# --- a disk that cannot hold the next prompt: the batch stops before computing it ----------------------


def _fill_after(monkeypatch, published: int, fill) -> list[int]:
    """Call `fill()` once `published` prompts were written; returns the list of rounds computed."""
    real_round, real_publish, rounds, done = batch_run.run_round, batch_run._Batch._publish, [], []

    def counted(*args, **kwargs):
        rounds.append(1)
        return real_round(*args, **kwargs)

    def publish(self, *args, **kwargs):
        real_publish(self, *args, **kwargs)
        done.append(1)
        if len(done) == published:
            fill()

    monkeypatch.setattr(batch_run, "run_round", counted)
    monkeypatch.setattr(batch_run._Batch, "_publish", publish)
    return rounds


@pytest.fixture
def small_disk(tmp_path):
    """An 8 MiB tmpfs (needs root; where mounting is not allowed, the ENOSPC test below covers the class)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.decode().strip()}); test_a_full_disk_while_publishing covers it")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.mark.parametrize("leave", [256 << 10, 0], ids=["batch.json still fits", "nothing fits"])
def test_a_batch_stops_when_the_disk_cannot_hold_the_next_prompt(h3, tmp_path, small_disk, monkeypatch, leave):
    prompts, out = _write(tmp_path / "p.txt", [f"prompt number {i}" for i in range(6)]), small_disk / "b"

    def fill():
        free = os.statvfs(small_disk).f_bavail * os.statvfs(small_disk).f_frsize
        with open(small_disk / "ballast", "wb") as f:
            try:
                f.write(b"\0" * max(0, free - leave))
            except OSError:
                pass

    computed = _fill_after(monkeypatch, 2, fill)
    code, _, err = _batch(h3, prompts, out)
    line = one_line(err)
    assert code == 1 and len(computed) == 2, err  # the third prompt was never computed
    summary = BatchReport.model_validate_json((out / "batch.json").read_text())
    assert not summary.complete
    if leave:  # the room check before the third prompt stopped it
        assert "free there and the next result needs about" in line and "the batch stopped" in summary.stopped
        assert _statuses(summary) == ["ok", "ok"] + ["pending"] * 4
    else:  # not even batch.json could be rewritten after the second: the one before it stays, whole
        assert "batch.json: no space left on the device" in line
        assert _statuses(summary) == ["ok"] + ["pending"] * 5
    assert _subfolders(out) == {"000-prompt-number-0", "001-prompt-number-1"}  # nothing half-written
    assert not [p for p in small_disk.iterdir() if p.name.startswith(".")]  # no staging, no lock


def test_a_full_disk_while_publishing_stops_the_batch(h3, tmp_path, monkeypatch):
    import h3core.reports.outputs as outputs

    prompts, out = _write(tmp_path / "p.txt", [f"prompt number {i}" for i in range(4)]), tmp_path / "b"
    real, writes = outputs.write_atomic, []

    def full_from_the_second_prompt(path, data):
        if Path(path).name == "latents.safetensors":
            writes.append(path)
            if len(writes) >= 2:
                raise OSError(errno.ENOSPC, "No space left on device")
        return real(path, data)

    monkeypatch.setattr(outputs, "write_atomic", full_from_the_second_prompt)
    computed = _fill_after(monkeypatch, 99, lambda: None)
    code, _, err = _batch(h3, prompts, out)
    assert code == 1 and "no space left on the device" in one_line(err)
    assert len(computed) == 2  # it stopped at the prompt it could not write, not after computing all four
    summary = BatchReport.model_validate_json((out / "batch.json").read_text())
    assert _statuses(summary) == ["ok", "pending", "pending", "pending"] and not summary.complete
    assert _subfolders(out) == {"000-prompt-number-0"}


# --- a batch folder deleted while the batch runs --------------------------------------------------------


@pytest.mark.parametrize("after", [1, 3], ids=["mid-run", "after the last prompt"])
def test_a_batch_whose_folder_is_deleted_reports_failure(h3, tmp_path, monkeypatch, after):
    prompts, out = _write(tmp_path / "p.txt", ["a red fox", "an owl", "a cat"]), tmp_path / "b"
    _fill_after(monkeypatch, after, lambda: shutil.rmtree(out))
    code, _, err = _batch(h3, prompts, out)
    assert code == 1 and "was deleted or replaced while the command ran" in one_line(err)
    assert not out.exists()  # never made again, half full


def test_a_finished_prompts_folder_removed_while_the_batch_runs_is_a_failure(h3, tmp_path, monkeypatch):
    prompts, out = _write(tmp_path / "p.txt", ["a red fox", "an owl"]), tmp_path / "b"
    _fill_after(monkeypatch, 2, lambda: shutil.rmtree(out / "000-a-red-fox"))
    code, report, err = _batch(h3, prompts, out)
    assert code == 1 and _statuses(report) == ["failed", "ok"]
    assert "was removed while the batch ran" in report.prompts[0].error
