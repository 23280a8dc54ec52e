"""The text encoder against transformers' Qwen3-VL in every layout h3 reads: a tiny random model
written by the test as the official / HF folder, as ComfyUI's single file cut after a layer (fp32),
and as that file in NVFP4-AWQ + int8 embedding quantized by comfy-kitchen (transformers runs the
dequantized weights). h3 must give `hidden_states[k]` -- the output of layer k, un-normed -- of
H3's tokenization of each prompt, to 1e-5 relative in float32, reading only the layers up to k
and never the vision tower or lm_head (both NaN in the files)."""

from __future__ import annotations

import weakref

import pytest
import torch
from qwen3_checkpoints import (
    HIDDEN,
    LAYERS,
    PROMPTS,
    comfy_names,
    comfy_nvfp4_awq,
    hidden_states,
    last_layer_unnormed,
    load_text_state,
    max_relative_error,
    official_folder,
    plain_folder,
    qwen3_config_json,
    qwen3_hidden_states,
    qwen3_reference,
    qwen3_vl_model,
    random_qwen3_state,
    tensor_bytes,
    train_tokenizer,
    write_file,
)

from h3core.text import load_text_encoder, release_text_encoder
from h3core.text.tokenizer import SHIPPED_FOLDER, shipped_tokenizer

TOLERANCE = 1e-5  # max |h3 - transformers| / max |transformers|, float32
CUT = 2  # the Comfy files keep layers 0..CUT-1 of LAYERS


@pytest.fixture(scope="module")
def vl():
    return qwen3_vl_model(seed=0)


@pytest.fixture(scope="module")
def official(tmp_path_factory, vl):
    """The tiny model in the official layout: FL2VA/text_encoder/ (index, 3 shards, config) and FL2VA/tokenizer/."""
    return official_folder(tmp_path_factory.mktemp("official") / "FL2VA", vl, SHIPPED_FOLDER)


@pytest.fixture(scope="module")
def prompt_ids() -> list[list[int]]:
    ids = [shipped_tokenizer().encode(p) for p in PROMPTS]
    assert 151669 in ids[1] and max(ids[2]) > 150_000  # a dialogue marker, and non-ASCII far into the vocabulary
    return ids


def _errors(encoder, expected_per_prompt) -> list[float]:
    return [max_relative_error(encoder.encode(p), e) for p, e in zip(PROMPTS, expected_per_prompt)]


@pytest.mark.parametrize("layer", [0, 1, 2])
def test_official_folder_matches_transformers(official, vl, prompt_ids, layer):
    root = official
    encoder = load_text_encoder(root, hidden_size=HIDDEN, output_layer=layer)
    errors = _errors(encoder, [hidden_states(vl, ids)[layer] for ids in prompt_ids])
    assert max(errors) <= TOLERANCE, errors
    info = encoder.info
    assert (info.kind, info.layers, info.checkpoint_layers, info.linears) == ("qwen3-vl", layer, LAYERS, "dense")
    assert info.tokenizer == str(root / "tokenizer") and info.config_source == str(root / "text_encoder" / "config.json")
    print(f"official folder, hidden_states[{layer}]: max relative error {max(errors):.2e}")


def test_official_folder_last_layer_is_not_normed_and_the_shards_folder_works_too(official, vl, prompt_ids):
    root = official
    encoder = load_text_encoder(root / "text_encoder", hidden_size=HIDDEN, output_layer=-1)  # the shards folder itself
    states = encoder.encode(PROMPTS[0])
    assert max_relative_error(states, last_layer_unnormed(vl, prompt_ids[0])) <= TOLERANCE
    assert max_relative_error(states, hidden_states(vl, prompt_ids[0])[LAYERS]) > 0.1  # HF's last entry is normed
    assert encoder.info.tokenizer == str(root / "tokenizer")  # the sibling tokenizer/ folder


def _visual_and_later_layers(tensors: dict[str, torch.Tensor]) -> None:
    assert any(k.startswith("visual.") for k in tensors) and all(torch.isnan(v).all() for k, v in tensors.items() if k.startswith("visual."))
    assert not any(k.startswith(f"model.layers.{CUT}.") or k == "model.norm.weight" for k in tensors)


def test_comfy_file_truncated_fp32_matches_transformers(tmp_path, vl, prompt_ids):
    tensors = comfy_names(vl, CUT)
    _visual_and_later_layers(tensors)
    path = write_file(tmp_path / "qwen3vl_comfy_fp32.safetensors", tensors)
    encoder = load_text_encoder(path, hidden_size=HIDDEN)  # output: the last layer present, un-normed
    errors = _errors(encoder, [hidden_states(vl, ids)[CUT] for ids in prompt_ids])
    assert max(errors) <= TOLERANCE, errors
    info = encoder.info
    assert (info.kind, info.layers, info.output_layer, info.tokenizer) == ("comfy", CUT, CUT, shipped_tokenizer().name)
    assert info.bytes_read == _layer_bytes(tensors) + _embedding_row_bytes(tensors, prompt_ids)
    print(f"comfy fp32, hidden_states[{CUT}]: max relative error {max(errors):.2e}")


def test_comfy_nvfp4_awq_int8_matches_transformers_on_the_dequantized_weights(tmp_path, vl, prompt_ids):
    tensors, reference_state = comfy_nvfp4_awq(vl, CUT)
    path = write_file(tmp_path / "qwen3vl_32b_minimax_h3_nvfp4_awq.safetensors", tensors)
    reference = qwen3_vl_model(seed=0)
    load_text_state(reference, reference_state)
    encoder = load_text_encoder(path, hidden_size=HIDDEN)
    errors = _errors(encoder, [hidden_states(reference, ids)[CUT] for ids in prompt_ids])
    assert max(errors) <= TOLERANCE, errors
    info = encoder.info
    assert (info.kind, info.linears, info.linear_layouts, info.layers) == ("comfy", "nvfp4", ["nvfp4-comfy"], CUT)
    assert info.bytes_read == _layer_bytes(tensors) + _embedding_row_bytes(tensors, prompt_ids)
    assert info.resident_bytes < _layer_bytes(tensors) * 1.01  # packed in memory, no embedding table
    print(f"comfy nvfp4-awq + int8 embedding, hidden_states[{CUT}]: max relative error {max(errors):.2e}; "
          f"read {info.bytes_read} of {info.bytes_on_disk} bytes")
    # The same weights without their AWQ pre-scales are another model: the pre-scale is applied.
    unscaled = qwen3_vl_model(seed=0)
    load_text_state(unscaled, _without_pre_scales(reference_state, tensors))
    assert max_relative_error(encoder.encode(PROMPTS[0]), hidden_states(unscaled, prompt_ids[0])[CUT]) > 1e-2


def _without_pre_scales(state: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = dict(state)
    for name, pre_scale in tensors.items():
        if name.endswith(".pre_quant_scale"):
            key = name.removeprefix("model.").removesuffix(".pre_quant_scale") + ".weight"
            out[key] = state[key] / pre_scale.float()
    return out


def _layer_bytes(tensors: dict[str, torch.Tensor]) -> int:
    """Every tensor of the layers kept, markers included, and the embedding's marker."""
    kept = {k: v for k, v in tensors.items() if k.startswith("model.layers.") or k == "model.embed_tokens.comfy_quant"}
    return tensor_bytes(kept)


def _embedding_row_bytes(tensors: dict[str, torch.Tensor], prompt_ids: list[list[int]]) -> int:
    """The embedding (and scale) rows of each prompt's distinct ids: all h3 reads of the table."""
    per_row = sum(tensors[name][0].numel() * tensors[name].element_size() for name in ("model.embed_tokens.weight", "model.embed_tokens.weight_scale") if name in tensors)
    return per_row * sum(len(set(ids)) for ids in prompt_ids)


def test_plain_qwen3_folder_matches_transformers(tmp_path):
    tokenizer = train_tokenizer(tmp_path / "tokenizer.json")
    state = random_qwen3_state(seed=3)
    folder = plain_folder(tmp_path / "qwen3", state, config=qwen3_config_json(), tokenizer=tokenizer, shards=2)
    encoder = load_text_encoder(folder, hidden_size=HIDDEN, output_layer=2)
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(tokenizer)).encode(PROMPTS[0]).ids
    assert encoder.tokenizer.encode(PROMPTS[0]) == ids
    assert max_relative_error(encoder.encode(PROMPTS[0]), qwen3_hidden_states(qwen3_reference(state), ids)[2]) <= TOLERANCE
    assert encoder.info.kind == "qwen3" and encoder.info.config_source == str(folder / "config.json")


def test_bf16_weights_stay_bf16(tmp_path, vl, prompt_ids):
    tensors = {k: v.to(torch.bfloat16) for k, v in comfy_names(vl, CUT).items()}
    encoder = load_text_encoder(write_file(tmp_path / "bf16.safetensors", tensors), hidden_size=HIDDEN)
    reference = qwen3_vl_model(seed=0)
    load_text_state(reference, {k: v.to(torch.bfloat16).float() for k, v in text_state_of(vl).items()})
    assert max_relative_error(encoder.encode(PROMPTS[1]), hidden_states(reference, prompt_ids[1])[CUT]) <= TOLERANCE
    assert encoder.info.resident_bytes == tensor_bytes({k: v for k, v in tensors.items() if k.startswith("model.layers.")})


def text_state_of(vl) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in vl.model.language_model.state_dict().items()}


def test_encode_ids_and_every_token_kept(tmp_path, vl, prompt_ids):
    path = write_file(tmp_path / "comfy.safetensors", comfy_names(vl, CUT))
    encoder = load_text_encoder(path, hidden_size=HIDDEN)
    long_prompt = " ".join(PROMPTS * 40)  # ~1,000 tokens: nothing is dropped
    ids = encoder.tokenizer.encode(long_prompt)
    states = encoder.encode(long_prompt)
    assert states.shape == (len(ids), HIDDEN) and len(ids) > 900
    assert torch.equal(encoder.encode_ids(ids), states)
    assert encoder.encode("").shape == (0, HIDDEN)


def test_release_frees_the_weights_and_closes_the_file(tmp_path, vl):
    encoder = load_text_encoder(write_file(tmp_path / "comfy.safetensors", comfy_names(vl, CUT)), hidden_size=HIDDEN)
    norm = weakref.ref(encoder._model.layers[0].input_norm.weight)
    release_text_encoder(encoder)
    assert norm() is None and encoder.released
    with pytest.raises(RuntimeError, match="released"):
        encoder.encode(PROMPTS[0])
    assert encoder.info.bytes_read > 0  # the report can still be made
