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
    vision = sorted(name for name in names if name.startswith("visual."))
    assert "visual.patch_embed.proj.weight" in vision and "visual.deepstack_merger_list.2.linear_fc2.bias" in vision
    assert "visual.blocks.3.attn.qkv.weight" in vision and not any(name.endswith("comfy_quant") for name in vision)
    with SafetensorsReader([info.path]) as reader:
        assert {reader.dtype_name(name) for name in vision} == {"BF16"} and reader.shape("visual.pos_embed.weight") == (2304, 64)
    assert info.vision and info.vision_resident_bytes == 0  # not read until a request has keyframes
    print(f"synthetic encoder (hidden 64) built and loaded in {build_seconds * 1e3:.0f} ms")


def _file_state(path) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, str]]:
    """The synthetic file as transformers' language model and vision tower state dicts (NVFP4 linears
    dequantized by comfy-kitchen, AWQ pre-scales folded in, bf16 widened), and its header."""
    import comfy_kitchen as ck

    with SafetensorsReader([path]) as reader:
        tensors = {name: reader.get(name) for name in reader.keys()}
        metadata = reader.metadata
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
    vision = {name.removeprefix("visual."): tensor.float() for name, tensor in tensors.items() if name.startswith("visual.")}
    return state, vision, metadata


def test_synthetic_file_runs_the_same_in_transformers(cache):
    path, _ = synthetic_text_encoder(64, seed=3)
    state, _, _ = _file_state(path)
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


def test_synthetic_keyframes_run_the_same_in_transformers(cache):
    """The synthetic tower (Comfy layout, bf16) and the presentation through transformers' Qwen3-VL
    built from the file's own header config: the same states with 1 and 2 images."""
    import json

    import numpy as np
    from PIL import Image
    from transformers import AutoTokenizer, Qwen3VLConfig, Qwen3VLForConditionalGeneration

    from h3core.text.tokenizer import SHIPPED_FOLDER

    path, _ = synthetic_text_encoder(64, seed=3)
    state, vision, metadata = _file_state(path)
    model = Qwen3VLForConditionalGeneration(Qwen3VLConfig(**json.loads(metadata["config"]))).eval()
    assert model.model.language_model.load_state_dict(state, strict=False).missing_keys == ["norm.weight"]
    model.model.visual.load_state_dict(vision)
    rng = np.random.default_rng(1)
    images = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for w, h in ((320, 256), (256, 320))]
    encoder = load_text_encoder(None, hidden_size=64, seed=3)
    tokenizer = AutoTokenizer.from_pretrained(str(SHIPPED_FOLDER))
    for count in (1, 2):
        states, tags = encoder.encode_prompt(PROMPT, images[:count])
        expected = _reference_with_images(model, tokenizer, images[:count])
        error = max_relative_error(states, expected)
        assert error <= 1e-5 and int((tags == 0).sum()) == sum(w * h // 1024 + 2 for w, h in ((320, 256), (256, 320))[:count])
        print(f"synthetic keyframes in transformers, {count} image(s): max relative error {error:.2e}")


def _reference_with_images(model, tokenizer, images) -> torch.Tensor:
    """The last layer's own output for diffusers' FL2VA presentation (official processor values)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    processor = Qwen2VLImageProcessorPil(size={"shortest_edge": 65536, "longest_edge": 16777216}, patch_size=16, temporal_patch_size=2,
                                         merge_size=2, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    vision = processor(images=images, return_tensors="pt")
    ids = []
    for index, grid in enumerate(vision["image_grid_thw"]):
        ids += tokenizer(f"<Picture {index + 1}>: ", add_special_tokens=False)["input_ids"] + [151652] + [151655] * (int(grid.prod()) // 4) + [151653]
    input_ids = torch.tensor([ids + tokenizer(PROMPT, add_special_tokens=False)["input_ids"]])
    captured = []
    hook = model.model.language_model.layers[-1].register_forward_hook(lambda m, a, out: captured.append(out))
    try:
        with torch.no_grad():
            model.model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), mm_token_type_ids=(input_ids == 151655).long(),
                        pixel_values=vision["pixel_values"], image_grid_thw=vision["image_grid_thw"], use_cache=False)
    finally:
        hook.remove()
    out = captured[0][0] if isinstance(captured[0], tuple) else captured[0]
    return out[0]


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
