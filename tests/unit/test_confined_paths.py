"""File names that files name (issue 36): a VAE config's `source_path` / `source_safetensors_path` and a
shard index's shards stay in their folder by one rule (`h3core.files.paths.inside`), and a JSONL
line's adapters, like its keyframes, are relative to the prompt file, wherever h3 is run from."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from h3core.batch.prompts import read_prompts
from h3core.decode.vae_files import find_vae_files
from h3core.errors import CheckpointError
from h3core.files.paths import inside


@pytest.mark.parametrize("name", ["/etc/passwd", "../x", "a/../../x", "a/..", "", "a\x00b", "..", "/"])
def test_a_name_that_leads_out_is_not_inside(tmp_path, name):
    assert inside(tmp_path, name) is None


@pytest.mark.parametrize("name", ["model.safetensors", "source/model.safetensors", "./a", "a/./b", "..a", "a..b"])
def test_a_name_in_the_folder_is_inside(tmp_path, name):
    assert inside(tmp_path, name) == tmp_path / name


def _minimax_vae(folder: Path, **names) -> Path:
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"_class_name": "MiniMaxH3VideoVAE", **names}))
    return folder


@pytest.mark.parametrize(
    "names",
    [
        {"source_path": "/etc"},
        {"source_path": "..", "source_safetensors_path": "outside.safetensors"},
        {"source_path": "source/../.."},
        {"source_safetensors_path": "/tmp/model.safetensors"},
        {"source_safetensors_path": "../model.safetensors"},
    ],
)
def test_a_vae_config_naming_weights_outside_its_folder_is_one_line(tmp_path, names):
    (tmp_path / "outside.safetensors").write_bytes(b"")
    folder = _minimax_vae(tmp_path / "vae", **names)
    with pytest.raises(CheckpointError, match="outside its folder; the config is corrupt or hostile") as caught:
        find_vae_files(folder, "video", "--video-vae")
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("names", [{"source_path": 5}, {"source_safetensors_path": ["a"]}, {"source_path": None}])
def test_a_vae_config_naming_weights_with_no_string_is_one_line(tmp_path, names):
    with pytest.raises(CheckpointError, match="must be file names"):
        find_vae_files(_minimax_vae(tmp_path / "vae", **names), "video", "--video-vae")


def test_a_vae_config_naming_weights_inside_reaches_them(tmp_path):
    folder = _minimax_vae(tmp_path / "vae", source_path="source", source_safetensors_path="absent.safetensors")
    with pytest.raises(CheckpointError, match=f"names the weights {folder}/source/absent.safetensors, which does not exist|nothing"):
        find_vae_files(folder, "video", "--video-vae")


def test_jsonl_adapters_and_keyframes_are_relative_to_the_prompt_file(tmp_path, monkeypatch):
    folder = tmp_path / "prompts"
    folder.mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    line = {"prompt": "a fox", "keyframes": {"first": "start.png"},
            "loras": [{"path": "style.safetensors", "scale": 0.5}, {"path": "/abs/turbo.safetensors"}, {"path": "sub/../ink.safetensors"}]}
    (folder / "p.jsonl").write_text(json.dumps(line) + "\n" + json.dumps({"prompt": "plain", "loras": []}) + "\n")
    first, plain = read_prompts(folder / "p.jsonl")
    assert [lora.path for lora in first.loras] == [str(folder / "style.safetensors"), "/abs/turbo.safetensors", str(folder / "sub/../ink.safetensors")]
    assert first.keyframes == {"first": folder / "start.png"}
    assert first.loras[0].scale == 0.5 and plain.loras == []
    specs = first.overrides()["loras"]
    assert [str(spec.path) for spec in specs] == [str(folder / "style.safetensors"), "/abs/turbo.safetensors", str(folder / "sub/../ink.safetensors")]
