"""`h3 generate --keyframe ROLE=PATH` and a `--prompts` line's `"keyframes"`: what a user can get wrong is
one line and exit 2 before any rank starts, and nothing is written; `--noise-recipe` takes its two names."""

from __future__ import annotations

import json

import pytest


@pytest.fixture(autouse=True)
def in_tmp(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)


@pytest.fixture
def image(tmp_path):
    from PIL import Image

    path = tmp_path / "start.png"
    Image.new("RGB", (96, 64), (200, 40, 10)).save(path)
    return path


def _one_line(code: int, err: str, needle: str) -> None:
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert needle in lines[0], lines[0]


@pytest.mark.parametrize(
    "values, needle",
    [
        (["middle={image}"], "role 'middle' is not one of first, last"),
        (["first={image}", "first={image}"], "--keyframe first= given twice"),
        (["{image}"], "give ROLE=PATH"),
        (["first="], "give ROLE=PATH"),
        (["first=missing.png"], "missing.png"),
        (["first={text}"], "text.txt"),
    ],
)
def test_bad_keyframes_are_one_line_and_write_nothing(h3, tmp_path, image, values, needle):
    text = tmp_path / "text.txt"
    text.write_text("not an image")
    args = [a for v in values for a in ("--keyframe", v.format(image=image, text=text))]
    code, out, err = h3("generate", *args, "--output", str(tmp_path / "run"))
    _one_line(code, err, needle)
    assert out == "" and not (tmp_path / "run").exists()


def test_width_without_height_with_keyframes_is_one_line(h3, tmp_path, image):
    code, _, err = h3("generate", "--keyframe", f"first={image}", "--width", "256", "--output", str(tmp_path / "run"))
    _one_line(code, err, "give --width and --height together, or neither")
    assert not (tmp_path / "run").exists()


def test_an_unknown_noise_recipe_is_one_line(h3, tmp_path):
    code, _, err = h3("generate", "--noise-recipe", "comfy", "--output", str(tmp_path / "run"))
    _one_line(code, err, "--noise-recipe 'comfy'")


@pytest.mark.parametrize(
    "keyframes, needle",
    [
        ({"middle": "start.png"}, "keyframe role 'middle' is not one of first, last"),
        ("start.png", '"keyframes" must be an object'),
        ({"first": 3}, "the first keyframe must be a path string"),
        ({"last": "missing.png"}, "missing.png"),
    ],
)
def test_a_bad_keyframes_field_in_a_prompts_file_is_one_line(h3, tmp_path, image, keyframes, needle):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "a fox", "keyframes": keyframes}) + "\n")
    code, out, err = h3("generate", "--prompts", str(prompts), "--output", str(tmp_path / "batch"))
    if needle == "missing.png":  # a file that is not there fails that prompt (recorded), not the file
        assert code == 1 and needle in out + err
    else:
        _one_line(code, err, needle)
        assert not (tmp_path / "batch").exists()


def _noise_image(path, seed: int, size=(120, 90)):
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).save(path)
    return path


def test_the_default_command_takes_a_keyframe_with_no_weights(h3, tmp_path):
    """`h3 generate --keyframe first=PATH` on the embedded synthetic weights: the canvas follows the image
    (4:3 -> 160x128 at tiny's short edge 128), one condition frame, `condition_video` in the latents; the
    same keyframe gives the same latents bit for bit, another keyframe other latents. The synthetic
    transformer and VAEs are random, so nothing makes the first frame look like the keyframe: what is
    measurable is that the output is a function of the keyframe (docs/keyframes.md)."""
    from safetensors.torch import load_file

    a, b = _noise_image(tmp_path / "a.png", 1), _noise_image(tmp_path / "b.png", 2)
    runs = {}
    for name, image in (("a", a), ("a-again", a), ("b", b)):
        code, out, err = h3("generate", "--keyframe", f"first={image}", "--steps", "3", "--no-decode", "--json", "--output", str(tmp_path / name))
        assert code == 0, err
        report = json.loads(out)
        runs[name] = load_file(str(tmp_path / name / "latents.safetensors"))
    assert report["canvas"]["width"] == 160 and report["canvas"]["height"] == 128 and "first keyframe" in report["canvas"]["reason"]
    assert report["rows"]["condition"] == 20 and report["keyframes"]["roles"] == ["first"] and report["noise_recipe"] == "official"
    assert runs["a"]["condition_video"].shape == (24, 1, 8, 10)
    assert all(torch_equal(runs["a"][k], runs["a-again"][k]) for k in ("video", "audio", "condition_video"))
    first_frame = (runs["a"]["video"][:, 0] - runs["b"]["video"][:, 0]).abs().mean()
    assert not torch_equal(runs["a"]["condition_video"], runs["b"]["condition_video"]) and float(first_frame) > 1e-3


def torch_equal(x, y) -> bool:  # type: ignore[no-untyped-def]
    import torch

    return torch.equal(x, y)
