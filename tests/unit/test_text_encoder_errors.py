"""Every broken text-encoder checkpoint a user can hand h3 ends in one clear CheckpointError line."""

from __future__ import annotations

import json

import pytest
import torch
from qwen3_checkpoints import (
    HIDDEN,
    LAYERS,
    plain_names,
    qwen3_config_json,
    random_qwen3_state,
    train_tokenizer,
    vl_names,
    write_checkpoint,
)

from h3core.errors import CheckpointError, ConfigError
from h3core.text import load_text_encoder


@pytest.fixture(scope="module")
def state() -> dict[str, torch.Tensor]:
    return random_qwen3_state(seed=2)


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory):
    return train_tokenizer(tmp_path_factory.mktemp("tokenizer") / "tokenizer.json")


def _fails(path, match: str, error: type[Exception] = CheckpointError, **kwargs) -> str:
    with pytest.raises(error, match=match) as caught:
        load_text_encoder(path, hidden_size=kwargs.pop("hidden_size", HIDDEN), **kwargs)
    message = str(caught.value)
    assert "\n" not in message and "Traceback" not in message
    return message


def test_missing_file(tmp_path):
    missing = tmp_path / "qwen3vl.safetensors"
    assert str(missing) in _fails(missing, "text encoder not found")


def test_folder_without_safetensors(tmp_path):
    _fails(tmp_path, "holds no .safetensors file")


def test_missing_tokenizer_names_the_file(tmp_path, state):
    folder = write_checkpoint(tmp_path, plain_names(state), config=qwen3_config_json(), tokenizer=None)
    assert str(folder / "tokenizer.json") in _fails(folder, "tokenizer not found")


def test_wrong_shape_in_a_later_layer(tmp_path, state, tokenizer_file):
    tensors = plain_names(state)
    tensors["model.layers.2.mlp.up_proj.weight"] = torch.randn(80, HIDDEN)
    folder = write_checkpoint(tmp_path, tensors, config=None, tokenizer=tokenizer_file)
    _fails(folder, r"model\.layers\.2\.mlp\.up_proj\.weight in .* has shape \[80, 64\] .* needs \[96, 64\]")


def test_wrong_norm_shape(tmp_path, state, tokenizer_file):
    tensors = plain_names(state)
    tensors["model.layers.1.self_attn.k_norm.weight"] = torch.ones(8)
    folder = write_checkpoint(tmp_path, tensors, config=qwen3_config_json(), tokenizer=tokenizer_file)
    _fails(folder, r"k_norm\.weight in .*\.safetensors has shape \[8\]")


def test_missing_tensor(tmp_path, state, tokenizer_file):
    tensors = plain_names(state)
    del tensors["model.layers.1.self_attn.o_proj.weight"]
    folder = write_checkpoint(tmp_path, tensors, config=qwen3_config_json(), tokenizer=tokenizer_file)
    _fails(folder, r"lacks tensor model\.layers\.1\.self_attn\.o_proj\.weight")


def test_missing_layer(tmp_path, state, tokenizer_file):
    tensors = {k: v for k, v in plain_names(state).items() if not k.startswith("model.layers.1.")}
    folder = write_checkpoint(tmp_path, tensors, config=None, tokenizer=tokenizer_file)
    _fails(folder, "lacks decoder layer 1")


def test_truncated_shard(tmp_path, state, tokenizer_file):
    folder = write_checkpoint(tmp_path, vl_names(state), config=qwen3_config_json(), tokenizer=tokenizer_file, shards=2)
    shard = folder / "model-00002-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])
    assert str(shard) in _fails(folder, "truncated")


def test_config_json_disagrees_with_shapes(tmp_path, state, tokenizer_file):
    config = qwen3_config_json() | {"num_hidden_layers": LAYERS + 1}
    folder = write_checkpoint(tmp_path, plain_names(state), config=config, tokenizer=tokenizer_file)
    message = _fails(folder, r"says num_layers = 4 but the checkpoint's tensors have num_layers = 3")
    assert str(folder / "config.json") in message


def test_qwen3_vl_config_json_disagrees_with_shapes(tmp_path, state, tokenizer_file):
    text = qwen3_config_json() | {"intermediate_size": 128}
    config = {"model_type": "qwen3_vl", "text_config": text, "vision_config": {"depth": 1}}
    folder = write_checkpoint(tmp_path, vl_names(state), config=config, tokenizer=tokenizer_file)
    _fails(folder, "says intermediate_size = 128 but the checkpoint's tensors have intermediate_size = 96")


def test_hidden_size_must_match_the_denoiser(tmp_path, state, tokenizer_file):
    folder = write_checkpoint(tmp_path, plain_names(state), config=qwen3_config_json(), tokenizer=tokenizer_file)
    _fails(folder, "hidden size 64 but the denoiser takes text of width 5120", hidden_size=5120)


def test_not_a_qwen3_checkpoint(tmp_path, tokenizer_file):
    folder = write_checkpoint(tmp_path, {"blocks.0.weight": torch.ones(4)}, config=None, tokenizer=tokenizer_file)
    _fails(folder, "not a Qwen3 / Qwen3-VL checkpoint")


def test_scaled_rope_is_refused(tmp_path, state, tokenizer_file):
    config = qwen3_config_json() | {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}}
    folder = write_checkpoint(tmp_path, plain_names(state), config=config, tokenizer=tokenizer_file)
    _fails(folder, "RoPE type 'yarn' is not implemented")


def test_unreadable_config_json(tmp_path, state, tokenizer_file):
    folder = write_checkpoint(tmp_path, plain_names(state), config=None, tokenizer=tokenizer_file)
    (folder / "config.json").write_text("{not json")
    _fails(folder, "cannot read .*config.json")


def test_tokenizer_that_does_not_belong_to_the_weights(tmp_path, state, tokenizer_file):
    tensors = plain_names(state)
    tensors["model.embed_tokens.weight"] = tensors["model.embed_tokens.weight"][:40]
    config = qwen3_config_json() | {"vocab_size": 40}
    folder = write_checkpoint(tmp_path, tensors, config=config, tokenizer=tokenizer_file)
    encoder = load_text_encoder(folder, hidden_size=HIDDEN)
    with pytest.raises(CheckpointError, match="does not belong to these weights"):
        encoder.encode("zebra quartz jukebox", 64)


def test_output_layer_out_of_range(tmp_path, state, tokenizer_file):
    folder = write_checkpoint(tmp_path, plain_names(state), config=qwen3_config_json(), tokenizer=tokenizer_file)
    _fails(folder, r"output layer 4 is outside -4\.\.3", error=ConfigError, output_layer=4)


def test_max_tokens_must_be_positive(tmp_path, state, tokenizer_file):
    folder = write_checkpoint(tmp_path, plain_names(state), config=json.loads(json.dumps(qwen3_config_json())), tokenizer=tokenizer_file)
    encoder = load_text_encoder(folder, hidden_size=HIDDEN)
    with pytest.raises(ConfigError, match="max_tokens must be at least 1"):
        encoder.encode("a fox", 0)


def _nvfp4_tensors(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    from h3core.nvfp4.io import linear_tensors
    from h3core.nvfp4.linear import NVFP4Linear

    tensors = plain_names(state)
    for name in [k for k in tensors if k.endswith("_proj.weight")]:
        prefix = name.removesuffix(".weight")
        tensors |= linear_tensors(prefix, NVFP4Linear.from_float(tensors.pop(name)))
    return tensors


def test_nvfp4_packed_weight_of_the_wrong_width(tmp_path, state, tokenizer_file):
    tensors = _nvfp4_tensors(state)
    tensors["model.layers.1.mlp.down_proj.weight"] = tensors["model.layers.1.mlp.down_proj.weight"][:, :40]
    folder = write_checkpoint(tmp_path, tensors, config=qwen3_config_json(), tokenizer=tokenizer_file)
    _fails(folder, r"down_proj\.weight in .* has shape \[64, 40\] but the text encoder config needs \[64, 48\]")


def test_nvfp4_block_scales_that_do_not_fit_the_weight(tmp_path, state, tokenizer_file):
    tensors = _nvfp4_tensors(state)
    tensors["model.layers.0.self_attn.q_proj.weight_scale"] = tensors["model.layers.0.self_attn.q_proj.weight_scale"][:, :2]
    folder = write_checkpoint(tmp_path, tensors, config=qwen3_config_json(), tokenizer=tokenizer_file)
    _fails(folder, r"q_proj\.weight_scale in .* expected F8_E4M3 \[64, 4\]")


def test_final_norm_needed_only_for_the_last_layer(tmp_path, state, tokenizer_file):
    tensors = {k: v for k, v in plain_names(state).items() if k != "model.norm.weight"}
    folder = write_checkpoint(tmp_path, tensors, config=qwen3_config_json(), tokenizer=tokenizer_file)
    _fails(folder, r"lacks tensor model\.norm\.weight")
    assert load_text_encoder(folder, hidden_size=HIDDEN, output_layer=-2).info.layers == LAYERS - 1
