"""The synthetic checkpoint is the seed's file layout at small widths, read through the one loader;
crafted or damaged files are one line; tensor mode reads only its shards' bytes."""

import pytest
import torch
from safetensors.torch import load_file, save_file

from h3core.errors import CheckpointError
from h3core.files.safetensors import read_header, write_safetensors
from h3core.generate.request import GenerateRequest, RunShape
from h3core.generate.sequences import build_sequence, noise_rows
from h3core.model.checkpoint import Checkpoint
from h3core.model.config import preset
from h3core.model.dit import Clocks
from h3core.model.synthetic import is_intact_synthetic, synthetic_checkpoint, synthetic_specs, synthetic_tensors
from h3core.nvfp4.codec import dequantize
from h3core.parallel.modes import Mode
from h3core.parallel.plan import ParallelPlan

CFG = preset("tiny")


@pytest.fixture(scope="module")
def ckpt_path(tmp_path_factory):
    path, built = synthetic_checkpoint(CFG, seed=3, directory=tmp_path_factory.mktemp("ckpt"))
    assert built
    return path


def _inputs(model, cfg=CFG):
    """The model input of every row of a 7-token prompt's sequence at the preset's size, with seeded noise."""
    shape = RunShape.of(cfg, GenerateRequest(steps=2))
    plan = ParallelPlan.build(cfg, 1, Mode.ULYSSES, cfg.segments(cfg.width, cfg.height, cfg.frames, 7)).sequences[0]
    with torch.inference_mode():
        seq = build_sequence(model, plan, torch.randn(7, cfg.text_dim, generator=torch.Generator().manual_seed(1)), shape, torch.device("cpu"))
    return seq.local_inputs(0, noise_rows(shape, 5)), Clocks.of({"video": 0.3, "audio": 0.6})


def test_cache_is_reused_and_deterministic(ckpt_path, tmp_path):
    again, built = synthetic_checkpoint(CFG, seed=3, directory=ckpt_path.parent)
    assert again == ckpt_path and not built
    other, _ = synthetic_checkpoint(CFG, seed=3, directory=tmp_path)
    a, b = load_file(str(other)), load_file(str(ckpt_path))  # same seed, same tensors
    assert a.keys() == b.keys() and all(torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8)) for k in a)
    different, _ = synthetic_checkpoint(CFG, seed=4, directory=tmp_path)
    assert different.name != other.name


def test_a_flipped_data_byte_in_the_cache_is_rebuilt_not_run_as_synthetic(ckpt_path, tmp_path):
    path, _ = synthetic_checkpoint(CFG, seed=3, directory=tmp_path)
    _, start, _ = read_header(path)
    data = bytearray(path.read_bytes())
    data[start + 100] ^= 0x40
    path.write_bytes(bytes(data))
    assert not is_intact_synthetic(path, CFG)
    rebuilt, built = synthetic_checkpoint(CFG, seed=3, directory=tmp_path)
    assert built and rebuilt == path and is_intact_synthetic(path, CFG)
    a, b = load_file(str(path)), load_file(str(ckpt_path))
    assert all(torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8)) for k in a)


def test_the_file_is_the_seed_layout_and_comfy_kitchen_reads_it(ckpt_path):
    """Original names, no prefix, pruned (adaln_t_table), block linears in Comfy NVFP4 with markers:
    comfy-kitchen's own decoder gives what h3's loader holds."""
    import comfy_kitchen as ck

    tensors = load_file(str(ckpt_path))
    assert set(tensors) == {s.name for s in synthetic_specs(CFG)} and "adaln_t_table" in tensors
    assert not any(k.startswith(("model.", "time_embedder.")) for k in tensors)
    assert bytes(tensors["blocks.0.mlp.fc2.comfy_quant"].tolist()) == b'{"format": "nvfp4"}'
    model = Checkpoint.open(ckpt_path, CFG).load()
    for prefix in ("blocks.0.attn.qkv_proj", "blocks.1.attn.out_proj", "blocks.1.mlp.fc1", "blocks.0.mlp.fc2"):
        theirs = ck.dequantize_nvfp4(tensors[f"{prefix}.weight"], tensors[f"{prefix}.weight_scale_2"], tensors[f"{prefix}.weight_scale"], torch.float32)
        assert torch.equal(dequantize(model.get_submodule(prefix).nvfp4), theirs)


def test_written_checkpoint_reproduces_the_in_memory_tensors(ckpt_path):
    tensors = synthetic_tensors(CFG, seed=3)
    on_disk = load_file(str(ckpt_path))
    assert all(torch.equal(tensors[k].reshape(-1).view(torch.uint8), on_disk[k].reshape(-1).view(torch.uint8)) for k in tensors)


def test_the_loaded_model_runs_and_keeps_its_fp32_islands(ckpt_path):
    model = Checkpoint.open(ckpt_path, CFG).load(dtype=torch.bfloat16)
    assert model.dtype == torch.bfloat16 and model.video_patch_proj.weight.dtype == torch.float32
    assert model.blocks[0].adaln_proj.linear.weight.dtype == torch.float32  # pruned: upcast as ComfyUI and SGLang do
    assert model.condition_proj.weight.dtype == torch.bfloat16 and model.adaln_t_table.dtype == torch.float32
    seq, clocks = _inputs(model)
    with torch.inference_mode():
        out = model(seq, clocks)
    assert out[next(iter(out))].dtype == torch.float32 and all(torch.isfinite(v).all() for v in out.values())


def test_config_comes_from_the_file_not_the_preset(ckpt_path):
    ck = Checkpoint.open(ckpt_path, preset("h3"))
    assert (ck.config.hidden, ck.config.num_heads, ck.config.ffn_dim, ck.config.pruned) == (CFG.hidden, CFG.num_heads, CFG.ffn_dim, True)
    assert ck.weights == "synthetic" and ck.config.width == preset("h3").width  # the run's defaults stay the preset's


def _rewrite(src, dst, edit):
    tensors = load_file(str(src))
    _, _, meta = read_header(src)
    edit(tensors, meta)
    save_file(tensors, str(dst), metadata=meta)
    return dst


def test_missing_key_is_named(ckpt_path, tmp_path):
    bad = _rewrite(ckpt_path, tmp_path / "bad.safetensors", lambda t, m: t.pop("blocks.1.norm2.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor 'blocks.1.norm2.weight'"):
        Checkpoint.open(bad, CFG).validate()


def test_wrong_shape_is_named(ckpt_path, tmp_path):
    def edit(t, m):
        t["blocks.0.norm1.weight"] = torch.zeros(CFG.hidden + 1, dtype=torch.bfloat16)

    bad = _rewrite(ckpt_path, tmp_path / "bad.safetensors", edit)
    with pytest.raises(CheckpointError, match=r"'blocks.0.norm1.weight' has shape \[97\], expected \[96\]"):
        Checkpoint.open(bad, CFG).validate()


@pytest.mark.parametrize("value", [0.0, -1.0, float("inf"), float("nan")])
def test_a_global_scale_that_is_not_positive_and_finite_is_refused(ckpt_path, tmp_path, value):
    bad = _rewrite(ckpt_path, tmp_path / "bad.safetensors", lambda t, m: t.update({"blocks.0.mlp.fc1.weight_scale_2": torch.tensor(value)}))
    with pytest.raises(CheckpointError, match=r"blocks.0.mlp.fc1.weight_scale_2 is .*; a global scale must be positive and finite"):
        Checkpoint.open(bad, CFG).load()


def test_a_wrong_rope_table_is_refused(ckpt_path, tmp_path):
    bad = _rewrite(ckpt_path, tmp_path / "bad.safetensors", lambda t, m: t.update({"rope.inv_freq": t["rope.inv_freq"] * 1.5}))
    with pytest.raises(CheckpointError, match="rope.inv_freq is not"):
        Checkpoint.open(bad, CFG)


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
    assert len(linears) == 4 * CFG.num_blocks and all(m.prepared for m in linears)
    assert device.resident_bytes(model) > device.resident_bytes(plain)  # the swizzled scales are counted

    def never(*args, **kwargs):
        raise AssertionError("fp4 operands built inside a forward")

    monkeypatch.setattr(linear_module, "prepare_fp4_weight", never)
    seq, clocks = _inputs(model)
    with torch.inference_mode():
        out = model(seq, clocks)
    assert all(torch.isfinite(v).all() for v in out.values())


def test_tensor_mode_shards_read_from_the_swizzled_file_are_slices_of_the_whole(ckpt_path, monkeypatch):
    """A shard read from the Comfy file (codes high nibble first, scales in 128x4 tiles) equals the same
    slice of the whole linear, for ragged row and block-aligned column ranges, and is prepared."""
    from h3core.nvfp4.linear import NVFP4Linear
    from h3core.parallel.partition import nvfp4_column_slices
    from h3core.span import Span

    monkeypatch.setattr(NVFP4Linear, "emulate_fp4", True)
    ckpt = Checkpoint.open(ckpt_path, CFG)
    whole = ckpt.load()
    source = ckpt.weight_source("cpu", torch.float32)
    odd = nvfp4_column_slices(CFG.ffn_dim, 6)[-1]  # 22 blocks over 6: the last rank holds 3 (48 inputs)
    shard = source.linear("blocks.0.mlp.fc2", columns=odd)
    full = dequantize(whole.blocks[0].mlp.fc2.nvfp4)
    assert odd.blocks % 2 and shard.prepared and shard.fp4_weight is not None
    assert shard.fp4_weight.shape == (CFG.hidden, 32)  # K 48 -> 64: 32 packed bytes per row
    assert torch.equal(dequantize(shard.nvfp4), full[:, odd.elements.start : odd.elements.stop])
    rows = [Span(5, 21), Span(133, 140), Span(300, 384)]  # across 128-row scale tiles
    shard = source.linear("blocks.1.attn.qkv_proj", rows=rows)
    full = dequantize(whole.blocks[1].attn.qkv_proj.nvfp4)
    assert torch.equal(dequantize(shard.nvfp4), torch.cat([full[s.start : s.stop] for s in rows]))


def test_a_full_precision_marker_never_takes_an_fp4_gemm_not_even_emulated(ckpt_path, tmp_path, monkeypatch):
    """`full_precision_matrix_mult` in a linear's comfy_quant: dequantize and multiply, on every device."""
    from h3core.nvfp4.comfy import ComfyQuant, marker_tensor
    from h3core.nvfp4.matmul import PATH_CPU_DEQUANT, PATH_CPU_FP4_EMULATED

    marked = "blocks.1.mlp.fc2"
    full = _rewrite(ckpt_path, tmp_path / "full.safetensors",
                    lambda t, m: t.update({f"{marked}.comfy_quant": marker_tensor(ComfyQuant("nvfp4", full_precision_matrix_mult=True))}))
    monkeypatch.setenv("H3_EMULATE_FP4", "1")
    model = Checkpoint.open(full, CFG).load()
    assert model.get_submodule(marked).path == PATH_CPU_DEQUANT
    assert model.get_submodule("blocks.0.mlp.fc2").path == PATH_CPU_FP4_EMULATED  # the others still emulate the fp4 GEMM
