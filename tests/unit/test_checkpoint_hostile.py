"""Crafted checkpoints, odd paths and a broken cache: one CheckpointError line each, never a crash;
the synthetic cache is derived data and is rebuilt, not reported as a download to repeat."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import h3core.model.synthetic as synthetic
from h3core.errors import CheckpointError
from h3core.model.checkpoint import Checkpoint
from h3core.model.config import preset
from h3core.model.synthetic import synthetic_checkpoint

CFG = preset("tiny")


@pytest.fixture(scope="module")
def tensors(tmp_path_factory) -> dict[str, torch.Tensor]:
    path, _ = synthetic_checkpoint(CFG, seed=0, directory=tmp_path_factory.mktemp("cache"))
    return load_file(str(path))


def _crafted(tmp_path: Path, tensors: dict, **changes) -> Path:
    """The tiny checkpoint (its config is always inferred from shapes), changed."""
    crafted = {**tensors, **{name.replace("__", "."): t for name, t in changes.items() if t is not None}}
    for name, t in changes.items():
        if t is None:
            crafted.pop(name.replace("__", "."))
    path = tmp_path / "crafted.safetensors"
    save_file({k: v.contiguous() for k, v in crafted.items()}, str(path), metadata={"format": "pt"})
    return path


@pytest.mark.parametrize(
    "changes, needle",
    [
        ({"blocks__extra__foo": torch.zeros(2)}, "tensor 'blocks.extra.foo' is not under a numbered block"),
        ({"video_patch_proj__weight": torch.zeros(96)}, "tensor 'video_patch_proj.weight' has shape [96], not a non-empty 2-D tensor"),
        ({"blocks__0__attn__q_norm__weight": torch.zeros(0)}, "tensor 'blocks.0.attn.q_norm.weight' has shape [0]"),
        ({"blocks__0__attn__q_norm__weight": torch.zeros(48)}, "the attention width (128) is not a multiple of 48"),
        ({"video_patch_proj__weight": torch.zeros(96, 7)}, "the video patch width (7) is not a multiple of 4"),
        ({"video_patch_proj__weight": None}, "has no tensor 'video_patch_proj.weight'"),
        ({"blocks__3__norm1__weight": torch.zeros(96)}, "blocks [2] under 'blocks.' are missing"),
    ],
)
def test_crafted_shapes_and_names_are_one_checkpoint_error(tmp_path, tensors, changes, needle):
    path = _crafted(tmp_path, tensors, **changes)
    with pytest.raises(CheckpointError) as err:
        Checkpoint.open(path, CFG)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_shapes_that_make_an_invalid_config_are_one_checkpoint_error(tmp_path, tensors):
    # a residual width of 100 is no multiple of 16: ModelConfig refuses it
    with pytest.raises(CheckpointError, match="its tensor shapes describe no valid H3 model"):
        Checkpoint.open(_crafted(tmp_path, tensors, video_patch_proj__weight=torch.zeros(100, 96)), CFG)


def test_a_folder_fifo_or_device_as_model_says_what_it_is(tmp_path):
    os.mkfifo(tmp_path / "pipe")
    cases = [(tmp_path, "holds no *.safetensors files"), (tmp_path / "pipe", "is a FIFO (named pipe), not a file"),
             (Path("/dev/null"), "is a character device, not a file"), (tmp_path / "absent", "H3 checkpoint not found")]
    for path, needle in cases:
        done: list[BaseException] = []
        worker = threading.Thread(target=lambda p=path: _open_into(p, done), daemon=True)
        worker.start()
        worker.join(5)  # opening a FIFO would block forever: it must never be opened
        assert done and isinstance(done[0], CheckpointError) and needle in str(done[0]), (path, done)


def _open_into(path: Path, done: list) -> None:
    try:
        Checkpoint.open(path, CFG)
    except BaseException as err:  # noqa: BLE001 - the test inspects it
        done.append(err)


def test_a_fifo_as_text_encoder_says_what_it_is(tmp_path):
    from h3core.text import check_text_encoder

    os.mkfifo(tmp_path / "encoder")
    with pytest.raises(CheckpointError, match="is a FIFO \\(named pipe\\), not a file or folder"):
        check_text_encoder(tmp_path / "encoder", hidden_size=64)


# --- the synthetic cache ---------------------------------------------------------------------------


def test_a_corrupt_or_foreign_cached_file_is_rebuilt(tmp_path):
    path, built = synthetic_checkpoint(CFG, seed=0, directory=tmp_path)
    good = {k: v.clone() for k, v in load_file(str(path)).items()}  # load_file maps the file: copy before changing it
    path.write_bytes(path.read_bytes()[:1000])  # truncated
    again, built = synthetic_checkpoint(CFG, seed=0, directory=tmp_path)
    assert again == path and built and _same({k: v.clone() for k, v in load_file(str(path)).items()}, good)
    foreign = CFG.model_copy(update={"steps": 7}).model_dump_json()
    save_file(good, str(path), metadata={"format": "pt", "h3_weights": "synthetic", "h3_config": foreign})  # readable, another config's
    assert synthetic_checkpoint(CFG, seed=0, directory=tmp_path)[1]
    assert Checkpoint.open(path, CFG).config.hidden == CFG.hidden and not synthetic_checkpoint(CFG, seed=0, directory=tmp_path)[1]


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8)) for k in a)


def test_an_unwritable_or_full_cache_folder_is_one_line(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match=r"cannot write the synthetic checkpoint \([\d.]+ [KMG]?i?B\) to the cache folder .*: .*; set H3_CACHE_DIR"):
        synthetic_checkpoint(CFG, seed=0, directory=tmp_path / "file" / "cache")
    monkeypatch.setattr(synthetic, "free_bytes", lambda folder: 0)
    with pytest.raises(CheckpointError, match="no space left on the device; set H3_CACHE_DIR to a writable folder"):
        synthetic_checkpoint(CFG, seed=0, directory=tmp_path / "full")
    assert not list((tmp_path / "full").glob("*.safetensors"))
