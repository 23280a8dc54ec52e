"""`h3 generate --prompts FILE` as a user runs it (in this process, 1 rank, tiny preset, 1 step):
a folder per prompt as `h3 generate` writes it, batch.json, a prompt that cannot run recorded as
failed while the rest run (exit 1), the same command again skipping what is done and redoing a
changed prompt, Ctrl-C keeping the finished prompts, and the one-line refusals."""

from __future__ import annotations

import json

import pytest

import h3core.batch.run as batch_run
from h3core.batch.report import BatchReport
from h3core.generate.report import RunReport

LINES = [
    {"prompt": "a red fox in snow", "seed": 3, "name": "fox"},
    {"prompt": "an owl at night", "width": 100},  # not a multiple of the VAE x patch: recorded, the rest run
    {"prompt": "rain on a tin roof", "guidance": 2.0, "negative_prompt": "blur"},
]


def _write(path, lines):
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def _batch(h3, prompts, out, *extra):
    code, stdout, err = h3("generate", "--prompts", str(prompts), "--steps", "2", "--output", str(out), "--json", *extra)
    return code, (BatchReport.model_validate_json(stdout) if stdout.strip() else None), err


def test_a_batch_writes_a_folder_per_prompt_records_failures_and_resumes(h3, tmp_path):
    prompts, out = _write(tmp_path / "p.jsonl", LINES), tmp_path / "batch"
    code, report, err = _batch(h3, prompts, out)
    assert code == 1 and "1 of 3 prompts failed (first: 001-an-owl-at-night: 100x" in err and err.count("\n") == 1
    assert [p.status.value for p in report.prompts] == ["ok", "failed", "ok"] and report.complete and report.loads == 1
    assert report.prompts[0].load_seconds > 0 and report.prompts[2].load_seconds == 0.0  # loaded once
    assert sorted(p.name for p in out.iterdir()) == ["000-fox", "002-rain-on-a-tin-roof", "batch.json"]
    for name in ("000-fox", "002-rain-on-a-tin-roof"):  # each exactly what `h3 generate` writes
        assert sorted(p.name for p in (out / name).iterdir()) == ["latents.safetensors", "preview.png", "report.json", "video.mp4"]
    assert BatchReport.model_validate_json((out / "batch.json").read_text()) == report

    # The same prompt alone through `h3 generate`: the same latents, bit for bit, and the same clip
    # (the batch loaded its VAEs once for both prompts).
    code, stdout, _ = h3("generate", "--prompt", "a red fox in snow", "--seed", "3", "--steps", "2", "-o", str(tmp_path / "one"), "--json")
    alone = RunReport.model_validate_json(stdout)
    batched = RunReport.model_validate_json((out / "000-fox" / "report.json").read_text())
    assert code == 0 and alone.video == batched.video and alone.audio == batched.audio
    assert alone.request_fingerprint == batched.request_fingerprint
    assert alone.decode.decoded == batched.decode.decoded
    assert (tmp_path / "one" / "video.mp4").read_bytes() == (out / "000-fox" / "video.mp4").read_bytes()
    rain = RunReport.model_validate_json((out / "002-rain-on-a-tin-roof" / "report.json").read_text())
    assert batched.decode.timings.load_s > 0 and rain.decode.timings.load_s == 0  # the ranks loaded the VAEs for the first prompt and held them

    # A result whose video.mp4 went missing is not complete: it is redone.
    (out / "002-rain-on-a-tin-roof" / "video.mp4").unlink()
    code, mended, _ = _batch(h3, prompts, out)
    assert [p.status.value for p in mended.prompts] == ["skipped", "failed", "ok"]

    # Again: the finished prompts are skipped, the failed one is tried again (and fails again).
    code, again, _ = _batch(h3, prompts, out)
    assert code == 1 and [p.status.value for p in again.prompts] == ["skipped", "failed", "skipped"] and again.resumed
    assert again.loads == 0 and again.text_encoder_seconds is None  # nothing to run: no rank, no encoder

    # A changed seed is redone; --overwrite redoes everything.
    _write(prompts, [{**LINES[0], "seed": 4}, *LINES[1:]])
    code, changed, _ = _batch(h3, prompts, out)
    assert [p.status.value for p in changed.prompts] == ["ok", "failed", "skipped"]
    assert RunReport.model_validate_json((out / "000-fox" / "report.json").read_text()).seed == 4
    code, redone, _ = _batch(h3, prompts, out, "--overwrite")
    assert [p.status.value for p in redone.prompts] == ["ok", "failed", "ok"]


def test_ctrl_c_keeps_the_finished_prompts_and_the_summary(h3, tmp_path, monkeypatch):
    prompts, out = _write(tmp_path / "p.jsonl", [LINES[0], LINES[2]]), tmp_path / "batch"
    real, calls = batch_run.run_round, []

    def interrupted_second(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(batch_run, "run_round", interrupted_second)
    code, _, err = _batch(h3, prompts, out)
    assert code == 130 and "interrupted (Ctrl-C) after 1 of 2 prompts" in err
    summary = BatchReport.model_validate_json((out / "batch.json").read_text())
    assert not summary.complete and summary.stopped == "interrupted (Ctrl-C)"
    assert [p.status.value for p in summary.prompts] == ["ok", "pending"]
    assert sorted(p.name for p in out.iterdir()) == ["000-fox", "batch.json"]  # nothing of the prompt in flight


@pytest.mark.parametrize(("args", "message"), [
    (("--prompt", "x"), "--prompts and --prompt given together"),
    (("--parity",), "--parity runs with one prompt"),
])
def test_flags_a_batch_cannot_take_are_one_line(h3, tmp_path, args, message):
    code, _, err = h3("generate", "--prompts", str(_write(tmp_path / "p.jsonl", LINES[:1])), *args)
    assert code == 2 and message in err and err.count("\n") == 1


def test_a_malformed_file_stops_before_anything_is_written(h3, tmp_path):
    bad = tmp_path / "p.jsonl"
    bad.write_text('{"prompt": "a"}\n{"prompt": "b", "steps": 0}\n')
    code, _, err = h3("generate", "--prompts", str(bad), "-o", str(tmp_path / "out"))
    assert code == 2 and f"{bad}, line 2: steps:" in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_a_folder_that_is_not_a_batch_is_refused(h3, tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    code, _, err = h3("generate", "--prompts", str(_write(tmp_path / "p.jsonl", LINES[:1])), "-o", str(tmp_path / "out"))
    assert code == 2 and "no batch.json" in err and (tmp_path / "out" / "notes.txt").read_text() == "mine"
