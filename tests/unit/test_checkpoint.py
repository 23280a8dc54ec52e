import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from h3core.errors import CheckpointError
from h3core.files.safetensors import write_safetensors
from h3core.generate.request import RunShape
from h3core.generate.sequences import build_sequence, noise_tokens
from h3core.model.checkpoint import Checkpoint
from h3core.model.config import preset
from h3core.model.synthetic import synthetic_checkpoint, synthetic_tensors
from h3core.parallel.plan import Mode, ParallelPlan

CFG = preset("tiny")


@pytest.fixture(scope="module")
def ckpt_path(tmp_path_factory):
    path, built = synthetic_checkpoint(CFG, seed=3, directory=tmp_path_factory.mktemp("ckpt"))
    assert built
    return path


def _inputs(cfg=CFG):
    """The model input of every row of a 7-token prompt's sequence at the preset's size, with seeded noise."""
    shape = RunShape(width=cfg.width, height=cfg.height, frames=cfg.frames, steps=2, shift=5.0,
                     video_latent=cfg.video_latent_shape(cfg.width, cfg.height, cfg.frames),
                     audio_latent=cfg.audio_latent_shape(cfg.frames), video_grid=cfg.video_grid(cfg.width, cfg.height, cfg.frames))
    plan = ParallelPlan.build(cfg, 1, Mode.ULYSSES, cfg.segments(cfg.width, cfg.height, cfg.frames, 7)).sequences[0]
    seq = build_sequence(cfg, plan, torch.randn(7, cfg.text_dim, generator=torch.Generator().manual_seed(1)), shape.video_grid, torch.device("cpu"))
    return seq.local_inputs(0, noise_tokens(cfg, shape, 5))


def test_cache_is_reused_and_deterministic(ckpt_path, tmp_path):
    again, built = synthetic_checkpoint(CFG, seed=3, directory=ckpt_path.parent)
    assert again == ckpt_path and not built
    other, _ = synthetic_checkpoint(CFG, seed=3, directory=tmp_path)
    a, b = load_file(str(other)), load_file(str(ckpt_path))  # same seed, same tensors
    assert a.keys() == b.keys() and all(torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8)) for k in a)
    different, _ = synthetic_checkpoint(CFG, seed=4, directory=tmp_path)
    assert different.name != other.name


def test_written_checkpoint_reproduces_the_in_memory_model(ckpt_path, tmp_path):
    from h3core.model.dit import H3Model

    tensors = synthetic_tensors(CFG, seed=3)
    input_scales = {k.removesuffix(".input_scale"): tensors.pop(k) for k in list(tensors) if k.endswith(".input_scale")}
    memory = H3Model(CFG)
    memory.load_state_dict({k: v if v.dtype in (torch.uint8, torch.float8_e4m3fn) or k.endswith("weight_scale_2") else v.float() for k, v in tensors.items()}, assign=True)
    for prefix, scale in input_scales.items():
        memory.get_submodule(prefix).input_scale = scale
    loaded = Checkpoint.open(ckpt_path, CFG).load()
    for prefix, scale in input_scales.items():  # the loader keeps every linear's static activation scale
        assert torch.equal(loaded.get_submodule(prefix).input_scale, scale)
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
    import h3core.files.safetensors as st

    def boom(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(st, "save_file", boom)  # the one writer every checkpoint goes through
    with pytest.raises(KeyboardInterrupt):
        write_safetensors(tmp_path / "c.safetensors", {"x": torch.zeros(2)}, {})
    assert list(tmp_path.iterdir()) == []


def test_report_write_is_atomic(tmp_path, monkeypatch):
    import os

    from h3core.reports import schema as report

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


def test_synthetic_input_scales_are_calibrated_amax_over_6x448(ckpt_path):
    """Like a ModelOpt export: every NVFP4 linear has input_scale = amax / (6 * 448), the amax of
    its input over the calibration pass rounded up to 3 significant bits."""
    import math

    from h3core.model.checkpoint import nvfp4_prefixes
    from h3core.model.synthetic import CALIBRATION_STEPS

    tensors = load_file(str(ckpt_path))
    model = Checkpoint.open(ckpt_path, CFG).load()
    prefixes = nvfp4_prefixes(model)
    assert len(prefixes) == 4 + 4 * CFG.num_blocks and CALIBRATION_STEPS >= 1
    for prefix in prefixes:
        scale = tensors[f"{prefix}.input_scale"]
        assert scale.dtype == torch.float32 and scale.shape == ()
        amax = float(scale) * 6 * 448  # float32 rounding of the division: within 1e-6 of a 3-bit number
        mantissa, exponent = math.frexp(amax)
        three_bits = math.ldexp(round(mantissa * 8) / 8, exponent)
        assert 0 < amax < 1e3 and torch.equal(scale, torch.tensor(three_bits / (6 * 448), dtype=torch.float32)), (prefix, amax)


def test_a_bad_input_scale_is_named(ckpt_path, tmp_path):
    def edit(t, m):
        t["blocks.0.attn.out.input_scale"] = torch.zeros(2)

    bad = _rewrite(ckpt_path, tmp_path / "bad.safetensors", edit)
    with pytest.raises(CheckpointError, match=r"'blocks.0.attn.out.input_scale' is torch.float32 \[2\], expected float32 \[\]"):
        Checkpoint.open(bad, CFG).validate()
    negative = _rewrite(ckpt_path, tmp_path / "neg.safetensors", lambda t, m: t.update({"time_in.input_scale": torch.tensor(-1.0)}))
    with pytest.raises(CheckpointError, match="time_in.input_scale is -1.0; it must be positive"):
        Checkpoint.open(negative, CFG).load()


def test_a_checkpoint_without_input_scales_still_loads(ckpt_path, tmp_path):
    plain = _rewrite(ckpt_path, tmp_path / "plain.safetensors", lambda t, m: [t.pop(k) for k in list(t) if k.endswith(".input_scale")])
    model = Checkpoint.open(plain, CFG).load()
    assert all(module.input_scale is None for name, module in model.named_modules() if hasattr(module, "input_scale"))


def test_fp4_operands_are_built_at_load_and_never_in_a_forward(ckpt_path, monkeypatch):
    """On the fp4 paths the swizzled scales (and padded weights) exist once the loader returns,
    are counted in the resident bytes, and a forward under inference_mode builds none."""
    from h3core.nvfp4 import linear as linear_module
    from h3core.nvfp4.linear import NVFP4Linear
    from h3core.runtime import device

    plain = Checkpoint.open(ckpt_path, CFG).load()
    monkeypatch.setattr(NVFP4Linear, "emulate_fp4", True)
    model = Checkpoint.open(ckpt_path, CFG).load()
    linears = [m for m in model.modules() if isinstance(m, NVFP4Linear)]
    assert linears and all(m.prepared for m in linears)
    assert device.resident_bytes(model) > device.resident_bytes(plain)  # the swizzled scales are counted

    def never(*args, **kwargs):
        raise AssertionError("fp4 operands built inside a forward")

    monkeypatch.setattr(linear_module, "prepare_fp4_weight", never)
    with torch.inference_mode():
        out = model(_inputs(), torch.tensor(0.5))
    assert all(torch.isfinite(v).all() for v in out.values())


def test_tensor_mode_shards_read_from_disk_are_prepared_and_padded(ckpt_path, monkeypatch):
    from h3core.nvfp4.linear import NVFP4Linear
    from h3core.parallel.partition import nvfp4_column_slices

    monkeypatch.setattr(NVFP4Linear, "emulate_fp4", True)
    ckpt = Checkpoint.open(ckpt_path, CFG)
    odd = nvfp4_column_slices(CFG.mlp_width, 6)[-1]  # 22 blocks over 6: the last rank holds 3 (48 inputs)
    shard = ckpt.weight_source("cpu").linear("blocks.0.mlp.fc2", columns=odd)
    assert odd.blocks % 2 and shard.prepared and shard.fp4_weight is not None
    assert shard.fp4_weight.shape == (CFG.hidden, 32)  # K 48 -> 64: 32 packed bytes per row
    assert shard.input_scale is not None  # the whole input's static scale, the same on every rank
