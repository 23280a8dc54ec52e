import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from h3core.checkpoint import Checkpoint, synthetic_checkpoint, synthetic_tensors, write_checkpoint
from h3core.config import preset
from h3core.errors import CheckpointError
from h3core.model import rope_table, token_positions
from h3core.pipeline import RunShape, build_sequence, local_inputs, noise_tokens
from h3core.partition import Span

CFG = preset("tiny")


@pytest.fixture(scope="module")
def ckpt_path(tmp_path_factory):
    path, built = synthetic_checkpoint(CFG, seed=3, directory=tmp_path_factory.mktemp("ckpt"))
    assert built
    return path


def _inputs(cfg=CFG):
    shape = RunShape(width=cfg.width, height=cfg.height, frames=cfg.frames, steps=2, shift=5.0,
                     video_latent=cfg.video_latent_shape(cfg.width, cfg.height, cfg.frames),
                     audio_latent=cfg.audio_latent_shape(cfg.frames), video_grid=cfg.video_grid(cfg.width, cfg.height, cfg.frames))
    seq = build_sequence(cfg, shape, torch.randn(7, cfg.text_dim, generator=torch.Generator().manual_seed(1)))
    rope = rope_table(cfg, token_positions(seq.segments, shape.video_grid))
    return local_inputs(seq, Span(0, seq.segments[-1].stop), noise_tokens(cfg, shape, 5), rope)


def test_cache_is_reused_and_deterministic(ckpt_path, tmp_path):
    again, built = synthetic_checkpoint(CFG, seed=3, directory=ckpt_path.parent)
    assert again == ckpt_path and not built
    other, _ = synthetic_checkpoint(CFG, seed=3, directory=tmp_path)
    a, b = load_file(str(other)), load_file(str(ckpt_path))  # same seed, same tensors
    assert a.keys() == b.keys() and all(torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8)) for k in a)
    different, _ = synthetic_checkpoint(CFG, seed=4, directory=tmp_path)
    assert different.name != other.name


def test_written_checkpoint_reproduces_the_in_memory_model(ckpt_path, tmp_path):
    from h3core.model import H3Model

    tensors = synthetic_tensors(CFG, seed=3)
    memory = H3Model(CFG)
    memory.load_state_dict({k: v if v.dtype in (torch.uint8, torch.float8_e4m3fn) or k.endswith("weight_scale_2") else v.float() for k, v in tensors.items()}, assign=True)
    loaded = Checkpoint.open(ckpt_path, CFG).load()
    inputs = _inputs()
    with torch.inference_mode():
        a, b = memory(inputs, torch.tensor(0.5)), loaded(inputs, torch.tensor(0.5))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_config_comes_from_the_file_not_the_preset(ckpt_path):
    ck = Checkpoint.open(ckpt_path, preset("h3"))
    assert ck.config.hidden == CFG.hidden and ck.weights == "synthetic"


def _rewrite(src, dst, edit):
    tensors = load_file(str(src))
    from safetensors import safe_open

    with safe_open(str(src), "pt") as f:
        meta = f.metadata()
    edit(tensors, meta)
    save_file(tensors, str(dst), metadata=meta)
    return dst


def test_missing_key_is_named(ckpt_path, tmp_path):
    bad = _rewrite(ckpt_path, tmp_path / "bad.safetensors", lambda t, m: t.pop("blocks.1.mlp.fc2.weight_scale"))
    with pytest.raises(CheckpointError, match=r"missing tensor 'blocks.1.mlp.fc2.weight_scale'"):
        Checkpoint.open(bad, CFG).validate()


def test_wrong_shape_is_named(ckpt_path, tmp_path):
    def edit(t, m):
        t["blocks.0.modulation"] = torch.zeros(3, 6, CFG.hidden + 1, dtype=torch.bfloat16)

    bad = _rewrite(ckpt_path, tmp_path / "bad.safetensors", edit)
    with pytest.raises(CheckpointError, match=r"'blocks.0.modulation' has shape \[3, 6, 129\], expected \[3, 6, 128\]"):
        Checkpoint.open(bad, CFG).validate()


def test_config_metadata_disagreeing_with_shapes(ckpt_path, tmp_path):
    def edit(t, m):
        cfg = json.loads(m["config"])
        cfg["mlp_width"] += 16
        m["config"] = json.dumps(cfg)

    bad = _rewrite(ckpt_path, tmp_path / "bad.safetensors", edit)
    with pytest.raises(CheckpointError, match="mlp_width=368 but the tensor shapes give 352"):
        Checkpoint.open(bad, CFG)


def test_file_without_config_metadata_is_inferred(ckpt_path, tmp_path):
    ok = _rewrite(ckpt_path, tmp_path / "plain.safetensors", lambda t, m: m.pop("config"))
    ck = Checkpoint.open(ok, CFG)
    assert ck.config.hidden == CFG.hidden and ck.config.mlp_width == CFG.mlp_width and ck.config.num_blocks == 2


@pytest.mark.parametrize("keep", [0.5, 0.999])
def test_truncated_file_fails_with_one_line(ckpt_path, tmp_path, keep):
    data = ckpt_path.read_bytes()
    bad = tmp_path / "truncated.safetensors"
    bad.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(CheckpointError) as err:
        Checkpoint.open(bad, CFG).load()
    assert "\n" not in str(err.value)


def test_missing_file(tmp_path):
    with pytest.raises(CheckpointError, match="H3 checkpoint not found.*H3_MODEL_PATH"):
        Checkpoint.open(tmp_path / "nope.safetensors", CFG)


def test_atomic_write_leaves_nothing_when_interrupted(tmp_path, monkeypatch):
    import h3core.checkpoint as ck

    def boom(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(ck, "save_file", boom)
    with pytest.raises(KeyboardInterrupt):
        write_checkpoint({"x": torch.zeros(2)}, tmp_path / "c.safetensors", {})
    assert list(tmp_path.iterdir()) == []


def test_report_write_is_atomic(tmp_path, monkeypatch):
    import os

    from h3core import report

    target = tmp_path / "report.json"
    report.write_report(target, report.Versions())
    before = target.read_text()

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError):
        report.write_report(target, report.Versions(h3="changed"))
    assert target.read_text() == before  # the old report is intact
    assert [p.name for p in tmp_path.iterdir()] == ["report.json"]  # no temp file left behind
