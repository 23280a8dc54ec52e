"""The synthetic text encoder: a seeded Qwen3-VL text path in the Comfy NVFP4-AWQ layout, cached on
disk and read through the same reader as H3's real file; transformers runs the same file (its
weights dequantized by comfy-kitchen) to the same states."""

from __future__ import annotations

import time

import pytest
import torch
from qwen3_checkpoints import hidden_states, last_layer_unnormed, max_relative_error

from h3core.errors import CheckpointError, ConfigError
from h3core.files.safetensors import SafetensorsReader
from h3core.nvfp4.linear import NVFP4Linear
from h3core.text import check_text_encoder, load_text_encoder, release_text_encoder
from h3core.text.synthetic import SYNTHETIC_VOCAB, synthetic_text_encoder
from h3core.text.tokenizer import shipped_tokenizer

PROMPT = "a red fox running through snow, wind noise <d>[English] Look!</d> 雪"


@pytest.fixture(autouse=True, scope="module")
def cache(tmp_path_factory):
    folder = tmp_path_factory.mktemp("h3-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("H3_CACHE_DIR", str(folder))
        yield folder


def test_synthetic_encoder_shape_info_and_layout(cache):
    started = time.perf_counter()
    encoder = load_text_encoder(None, hidden_size=64, seed=3)
    build_seconds = time.perf_counter() - started
    states = encoder.encode(PROMPT)
    assert states.shape == (len(shipped_tokenizer().encode(PROMPT)), 64) and states.dtype == torch.float32
    assert torch.isfinite(states).all() and states.std() > 0.1
    info = encoder.info
    assert (info.kind, info.tokenizer, info.linears, info.linear_layouts) == ("synthetic", shipped_tokenizer().name, "nvfp4", ["nvfp4-comfy"])
    assert (info.layers, info.checkpoint_layers, info.output_layer, info.hidden_size) == (3, 3, 3, 64)
    assert info.path.startswith(str(cache)) and info.bytes_read < info.bytes_on_disk / 50
    assert sum(isinstance(m, NVFP4Linear) for m in encoder._model.modules()) == 3 * 7
    with SafetensorsReader([info.path]) as reader:
        names = set(reader.keys())
        assert reader.dtype_name("model.embed_tokens.weight") == "I8" and reader.shape("model.embed_tokens.weight_scale") == (SYNTHETIC_VOCAB, 1)
    assert "model.layers.2.mlp.down_proj.pre_quant_scale" in names and "model.layers.2.mlp.up_proj.pre_quant_scale" not in names
    assert "model.norm.weight" not in names and "model.layers.2.self_attn.q_proj.comfy_quant" in names
    print(f"synthetic encoder (hidden 64) built and loaded in {build_seconds * 1e3:.0f} ms")


def test_synthetic_file_runs_the_same_in_transformers(cache):
    import comfy_kitchen as ck

    path, _ = synthetic_text_encoder(64, seed=3)
    with SafetensorsReader([path]) as reader:
        tensors = {name: reader.get(name) for name in reader.keys()}
    state = {"embed_tokens.weight": tensors["model.embed_tokens.weight"].float() * tensors["model.embed_tokens.weight_scale"]}
    for name, tensor in tensors.items():
        key = name.removeprefix("model.")
        if name.endswith("norm.weight") and name.startswith("model.layers."):
            state[key] = tensor.float()
        elif name.endswith("_proj.weight"):
            prefix = name.removesuffix(".weight")
            dense = ck.dequantize_nvfp4(tensor, tensors[f"{prefix}.weight_scale_2"], tensors[f"{prefix}.weight_scale"], torch.float32)
            pre_scale = tensors.get(f"{prefix}.pre_quant_scale")
            state[key] = dense if pre_scale is None else dense * pre_scale.float()
    reference = _reference_model(state)
    ids = shipped_tokenizer().encode(PROMPT)
    expected = last_layer_unnormed(reference, ids)  # the last layer's own output: hidden_states[3] is final-normed
    assert max_relative_error(load_text_encoder(None, hidden_size=64, seed=3, output_layer=2).encode(PROMPT), hidden_states(reference, ids)[2]) <= 1e-5
    error = max_relative_error(load_text_encoder(None, hidden_size=64, seed=3).encode(PROMPT), expected)
    assert error <= 1e-5
    print(f"synthetic file in transformers (comfy-kitchen dequantized): max relative error {error:.2e}")


def _reference_model(state):
    """transformers' Qwen3-VL with the synthetic config (3 layers of 4 x 16 heads, SwiGLU 64)."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    rope = {"rope_type": "default", "rope_theta": 5e6, "mrope_section": [4, 2, 2], "mrope_interleaved": True}
    text = dict(vocab_size=SYNTHETIC_VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_parameters=rope)
    config = Qwen3VLConfig(text_config=text, vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                                                                out_hidden_size=64, deepstack_visual_indexes=[0], num_position_embeddings=16, patch_size=4))
    model = Qwen3VLForConditionalGeneration(config).eval()
    missing = model.model.language_model.load_state_dict(state, strict=False)
    assert missing.missing_keys == ["norm.weight"] and not missing.unexpected_keys  # the synthetic file ends before the final norm
    return model


def test_synthetic_encoder_is_deterministic_and_cached(cache):
    first = load_text_encoder(None, hidden_size=64, seed=7).encode(PROMPT)
    path, built = synthetic_text_encoder(64, seed=7)
    assert not built  # the cached file is reused
    assert torch.equal(load_text_encoder(None, hidden_size=64, seed=7).encode(PROMPT), first)
    assert not torch.allclose(load_text_encoder(None, hidden_size=64, seed=8).encode(PROMPT), first)
    path.write_bytes(path.read_bytes()[:-1000])  # a truncated cache entry is derived data: rebuilt
    assert synthetic_text_encoder(64, seed=7) == (path, True)
    assert torch.equal(load_text_encoder(None, hidden_size=64, seed=7).encode(PROMPT), first)


def test_every_token_of_the_shipped_tokenizer_has_a_row():
    tokenizer = check_text_encoder(None, hidden_size=64)
    assert tokenizer.vocab_size == 151_676 <= SYNTHETIC_VOCAB
    encoder = load_text_encoder(None, hidden_size=64)
    assert encoder.encode_ids([0, 151_675, SYNTHETIC_VOCAB - 1]).shape == (3, 64)


def test_synthetic_output_layer_zero_is_the_int8_embedding(cache):
    encoder = load_text_encoder(None, hidden_size=64, output_layer=0)
    assert encoder.info.layers == 0
    with SafetensorsReader([encoder.info.path]) as reader:
        rows = reader.get("model.embed_tokens.weight")[[5, 151_670]].float() * reader.get("model.embed_tokens.weight_scale")[[5, 151_670]]
    assert torch.equal(encoder.encode_ids([5, 151_670]), rows)


def test_synthetic_encoder_at_h3_width_is_light(cache):
    started = time.perf_counter()
    encoder = load_text_encoder(None, hidden_size=5120)
    seconds = time.perf_counter() - started
    assert encoder.encode("fox").shape == (1, 5120)
    info = encoder.info
    assert info.resident_bytes < 8 * 2**20 and info.bytes_read < 8 * 2**20 < 700 * 2**20 < info.bytes_on_disk
    release_text_encoder(encoder)
    print(f"synthetic encoder (hidden 5120): built and loaded in {seconds:.1f} s, {info.bytes_on_disk / 2**20:.0f} MiB on disk, "
          f"{info.resident_bytes / 2**20:.2f} MiB resident, {info.bytes_read / 2**20:.2f} MiB read")


def test_synthetic_width_must_be_whole_nvfp4_blocks():
    with pytest.raises(ConfigError, match="not a positive multiple of 16"):
        load_text_encoder(None, hidden_size=72)
    with pytest.raises(ConfigError, match="not a positive multiple of 16"):
        check_text_encoder(None, hidden_size=72)


def test_an_unusable_cache_folder_is_one_line(tmp_path, monkeypatch):
    in_the_way = tmp_path / "cache"
    in_the_way.write_text("a file where the cache folder should be")
    monkeypatch.setenv("H3_CACHE_DIR", str(in_the_way))
    with pytest.raises(CheckpointError, match="cannot write the synthetic text encoder .* set H3_CACHE_DIR") as caught:
        load_text_encoder(None, hidden_size=32, seed=11)
    assert "\n" not in str(caught.value)
