"""h3's transformer equals diffusers 0.42.1's `MiniMaxH3Transformer3DModel` on the same weights, for
every checkpoint layout h3 reads (the reference implementation is the specification).

A small random diffusers model is written by the test into each layout (tests/h3_reference.py: the
original names are checked against diffusers' own converter; NVFP4 tensors are comfy-kitchen's),
loaded through `h3core.model.load_transformer`, and run, through the diffusers-argument adapter
(`h3core.model.packing.diffusers_forward`), on one packed t2va step built by diffusers' pipeline steps. Bound: 1e-5 relative (max |diff| / max |ref|) in fp32; measured values are printed
by `-s` and recorded in docs/checkpoint.md. A mutation (the fc1 halves read the wrong way round, the
qkv rows read stacked from interleaved shards) must exceed it.
"""

from __future__ import annotations

import pytest
import torch

import h3_reference as ref
from h3core.errors import CheckpointError
from h3core.model.checkpoint import Checkpoint, load_transformer
from h3core.model.config import preset
from h3core.model.packing import diffusers_forward

BOUND = 1e-5


def _compare(model, path, inputs=None) -> tuple[float, float]:
    inputs = inputs or ref.packed_inputs(model)
    with torch.no_grad():
        expected = model(**inputs, return_dict=False)
        got = diffusers_forward(load_transformer(path), **inputs)
    errors = tuple(ref.relative_error(a, b) for a, b in zip(got, expected))
    print(f"{path.name}: video {errors[0]:.2e}, audio {errors[1]:.2e}")
    return errors


@pytest.fixture(scope="module")
def full():
    model = ref.random_model()
    return model, ref.original_state(model)


def test_comfy_single_file(full, tmp_path):
    model, state = full
    assert max(_compare(model, ref.write_single(tmp_path / "comfy.safetensors", state))) <= BOUND


def test_comfy_single_file_with_prefix(full, tmp_path):
    model, state = full
    path = ref.write_single(tmp_path / "prefixed.safetensors", state, prefix="model.diffusion_model.")
    assert max(_compare(model, path)) <= BOUND


def test_official_shards_interleaved_qkv(full, tmp_path):
    model, state = full
    cfg = model.config
    folder = ref.write_sharded(tmp_path / "transformer", ref.interleave_qkv(state, cfg.num_attention_heads, cfg.attention_head_dim))
    assert max(_compare(model, folder)) <= BOUND


def test_diffusers_folder(full, tmp_path):
    model, _ = full
    model.save_pretrained(tmp_path / "transformer", max_shard_size="100KB")  # sharded, with its index and config.json
    assert (tmp_path / "transformer" / "diffusion_pytorch_model.safetensors.index.json").is_file()
    assert max(_compare(model, tmp_path / "transformer")) <= BOUND


@pytest.mark.parametrize("layout", ["comfy", "modelopt"])
def test_nvfp4_block_linears_against_the_dequantized_model(layout, tmp_path):
    model = ref.random_model(seed=5)
    stored, dense = ref.quantize_block_linears(ref.original_state(model), layout)
    ref.load_dense(model, dense)
    assert max(_compare(model, ref.write_single(tmp_path / f"{layout}.safetensors", stored))) <= BOUND


def test_pruned_variant_against_its_formula(tmp_path):
    model = ref.random_model(seed=7)
    state = ref.original_state(model)
    pruned = ref.prune(model)
    path = ref.write_single(tmp_path / "pruned.safetensors", ref.pruned_state(state, pruned))
    for t_video, t_audio in ((0.0, 0.0), (0.3, 0.55), (0.999, 1.0)):
        assert max(_compare(model, path, ref.packed_inputs(model, t_video=t_video, t_audio=t_audio))) <= BOUND


def test_pruned_nvfp4_as_the_seed_file_is_laid_out(tmp_path):
    """The seed's layout: pruned, block linears NVFP4 with markers, no prefix."""
    model = ref.random_model(seed=9)
    state = ref.original_state(model)
    pruned = ref.prune(model)
    stored, dense = ref.quantize_block_linears(ref.pruned_state(state, pruned), "comfy")
    ref.load_dense(model, dense)
    assert max(_compare(model, ref.write_single(tmp_path / "pruned-nvfp4.safetensors", stored))) <= BOUND


def test_trailing_bytes_after_the_last_tensor_are_accepted(full, tmp_path):
    """The seed's NVFP4 file carries 65 bytes after its payload; strict loaders refuse it, h3 must not."""
    model, state = full
    path = ref.write_single(tmp_path / "tail.safetensors", state)
    with open(path, "ab") as f:
        f.write(b"\nL2P_bypass_" + b"x" * 52 + b"\n")
    assert max(_compare(model, path)) <= BOUND


def test_mutation_interleaved_shards_read_as_stacked_exceed_the_bound(full, tmp_path):
    """The official shards' qkv in a single file reads as stacked: the wrong rows, far beyond the bound."""
    model, state = full
    cfg = model.config
    path = ref.write_single(tmp_path / "wrong.safetensors", ref.interleave_qkv(state, cfg.num_attention_heads, cfg.attention_head_dim))
    assert min(_compare(model, path)) > 100 * BOUND


def test_mutation_swapped_fc1_halves_exceed_the_bound(full, tmp_path):
    model, state = full
    swapped = dict(state)
    for name, tensor in state.items():
        if name.endswith(".mlp.fc1.weight"):
            gate, up = tensor.chunk(2)
            swapped[name] = torch.cat([up, gate])
    assert min(_compare(model, ref.write_single(tmp_path / "fc1.safetensors", swapped))) > 100 * BOUND


def test_config_read_from_the_shapes(full, tmp_path):
    model, state = full
    config = Checkpoint.open(ref.write_single(tmp_path / "c.safetensors", state), preset("tiny")).config
    cfg = model.config
    assert (config.hidden, config.num_heads, config.head_dim, config.num_blocks, config.refiner_blocks, config.ffn_dim) == (
        cfg.hidden_size, cfg.num_attention_heads, cfg.attention_head_dim, cfg.num_layers, cfg.num_refiner_layers, cfg.ffn_dim)
    assert (config.text_dim, config.time_embed_dim, config.rope_freq_dim, config.pruned) == (cfg.text_dim, cfg.time_embed_dim, cfg.rope_freq_dim, False)


def test_a_file_of_no_known_layout_is_one_line(tmp_path):
    path = ref.write_single(tmp_path / "other.safetensors", {"model.embed_tokens.weight": torch.zeros(4, 4)})
    with pytest.raises(CheckpointError, match="not an H3 transformer checkpoint: found model.embed_tokens.weight; expected blocks.0"):
        load_transformer(path)


def test_an_unknown_quantization_format_is_named(full, tmp_path):
    model, state = full
    stored, _ = ref.quantize_block_linears(state, "comfy")
    stored["blocks.0.attn.qkv_proj.comfy_quant"] = torch.tensor(list(b'{"format": "int8_tensorwise"}'), dtype=torch.uint8)
    with pytest.raises(CheckpointError, match="blocks.0.attn.qkv_proj is quantized as 'int8_tensorwise'"):
        load_transformer(ref.write_single(tmp_path / "int8.safetensors", stored))


@pytest.mark.parametrize("marker", [b"not json", b'{"fmt": 1}', b'{"format": "nvfp4", "full_precision_matrix_mult": "yes"}'])
def test_a_broken_marker_is_one_line(full, tmp_path, marker):
    model, state = full
    stored, _ = ref.quantize_block_linears(state, "comfy")
    stored["blocks.1.mlp.fc2.comfy_quant"] = torch.tensor(list(marker), dtype=torch.uint8)
    with pytest.raises(CheckpointError, match="blocks.1.mlp.fc2"):
        load_transformer(ref.write_single(tmp_path / "bad.safetensors", stored))


def test_a_marker_that_lies_about_the_dtype_is_refused(full, tmp_path):
    model, state = full
    stored = dict(state)
    stored["blocks.0.mlp.fc1.comfy_quant"] = torch.tensor(list(b'{"format": "nvfp4"}'), dtype=torch.uint8)
    with pytest.raises(CheckpointError, match="says nvfp4 but blocks.0.mlp.fc1.weight is F32"):
        load_transformer(ref.write_single(tmp_path / "lie.safetensors", stored))
