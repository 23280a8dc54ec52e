"""`h3 generate --lora PATH[:SCALE]` and a JSONL line's `loras` as a user runs them (in this process,
1 rank, tiny preset): the report records each adapter; a batch changes adapters per prompt without
reloading the base, each prompt's latents those of `h3 generate` with the same adapters alone; every
bad adapter is one line and exit 2 before any rank starts, with nothing written."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from h3core.batch.report import BatchReport
from h3core.generate.report import RunReport
from h3core.lora.synthetic import write_synthetic_adapter
from h3core.model.config import preset


@pytest.fixture
def adapters(tmp_path):
    config = preset("tiny")
    return {"kohya": write_synthetic_adapter(tmp_path / "kohya.safetensors", config, rank=8, seed=1, fmt="kohya", alpha=4.0, std=0.1),
            "peft": write_synthetic_adapter(tmp_path / "peft.safetensors", config, rank=4, seed=2, fmt="peft", std=0.1)}


def _generate(h3, out, *args):
    code, stdout, err = h3("generate", "--steps", "2", "--no-decode", "--output", str(out), "--json", *args)
    assert code == 0, err
    return RunReport.model_validate_json(stdout)


def test_the_report_records_every_adapter(h3, tmp_path, adapters):
    report = _generate(h3, tmp_path / "run", "--lora", str(adapters["kohya"]), "--lora", f"{adapters['peft']}:0.5")
    kohya, peft = report.adapters
    assert (kohya.name, kohya.format, kohya.scale, kohya.layers) == ("kohya", "kohya", 1.0, 16)
    assert (peft.name, peft.format, peft.scale, peft.layers, peft.pairs) == ("peft", "peft", 0.5, 16, 24)
    assert len(kohya.sha256) == 64 and report.ranks[0].adapter_bytes == kohya.bytes_per_rank[0] + peft.bytes_per_rank[0] > 0
    assert "branch" in report.adapters_applied
    plain = _generate(h3, tmp_path / "plain")
    assert plain.video != report.video and plain.request_fingerprint != report.request_fingerprint


def test_a_batch_swaps_adapters_per_prompt_without_reloading_the_base(h3, tmp_path, adapters):
    lines = [{"prompt": "a fox", "seed": 1, "name": "kohya", "loras": [{"path": str(adapters["kohya"])}]},
             {"prompt": "a fox", "seed": 1, "name": "none", "loras": []},
             {"prompt": "a fox", "seed": 1, "name": "both", "loras": [{"path": str(adapters["peft"]), "scale": 0.5}, {"path": str(adapters["kohya"])}]},
             {"prompt": "a fox", "seed": 1, "name": "flags"}]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(line) + "\n" for line in lines))
    code, stdout, err = h3("generate", "--prompts", str(prompts), "--steps", "2", "--no-decode", "--output", str(tmp_path / "batch"), "--json",
                           "--lora", f"{adapters['peft']}:0.25")
    report = BatchReport.model_validate_json(stdout)
    assert code == 0 and report.loads == 1 and [p.load_seconds == 0.0 for p in report.prompts] == [False, True, True, True], err
    asked = {"kohya": ["--lora", str(adapters["kohya"])], "none": [],
             "both": ["--lora", f"{adapters['peft']}:0.5", "--lora", str(adapters["kohya"])], "flags": ["--lora", f"{adapters['peft']}:0.25"]}
    videos = set()
    for i, (name, args) in enumerate(asked.items()):
        batched = RunReport.model_validate_json((tmp_path / "batch" / f"{i:03d}-{name}" / "report.json").read_text())
        alone = _generate(h3, tmp_path / name, "--prompt", "a fox", "--seed", "1", *args)
        assert alone.video == batched.video and alone.audio == batched.audio, name  # bit for bit
        assert [a.name for a in batched.adapters] == [a.name for a in alone.adapters]
        videos.add(batched.video.sha256)
    assert len(videos) == 4  # four different results from one load


def _refused(h3, tmp_path, *args) -> str:
    code, out, err = h3("generate", "--steps", "2", "--output", str(tmp_path / "run"), *args)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in err and out == "", err
    assert not (tmp_path / "run").exists()
    return lines[0]


def test_bad_adapters_are_one_line_and_exit_2_before_any_rank(h3, tmp_path, adapters):
    other = tmp_path / "other.safetensors"
    save_file({"text_model.encoder.layers.0.q_proj.lora_A.weight": torch.zeros(2, 4), "text_model.encoder.layers.0.q_proj.lora_B.weight": torch.zeros(4, 2)}, str(other))
    wide = write_synthetic_adapter(tmp_path / "wide.safetensors", preset("narrow"), rank=4)
    nan = tmp_path / "nan.safetensors"
    tensors = {k: v.clone() for k, v in __import__("safetensors.torch", fromlist=["load_file"]).load_file(str(adapters["kohya"])).items()}
    tensors["diffusion_model.blocks.1.mlp.fc1.lora_up.weight"][0, 0] = float("nan")
    save_file(tensors, str(nan))
    assert "no key names a linear of the MiniMax-H3 transformer" in _refused(h3, tmp_path, "--lora", str(other))
    assert "an adapter for another model size" in _refused(h3, tmp_path, "--lora", str(wide))
    assert "holds NaN or infinite values" in _refused(h3, tmp_path, "--lora", str(nan))
    assert "is not a finite number" in _refused(h3, tmp_path, "--lora", f"{adapters['kohya']}:nan")
    assert "does not exist" in _refused(h3, tmp_path, "--lora", str(tmp_path / "missing.safetensors"))
