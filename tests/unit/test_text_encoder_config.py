"""config.json parsing for the text encoder: transformers 4.x and 5.x layouts of Qwen3 and Qwen3-VL."""

from __future__ import annotations

from pathlib import Path

import pytest

from h3core.errors import CheckpointError
from h3core.text.config import merge_config, text_fields

WHERE = Path("config.json")

# The text part of Qwen3-VL-32B-Instruct's config.json as transformers 4.57 writes it.
QWEN3_VL_32B_V4 = {
    "model_type": "qwen3_vl",
    "text_config": {
        "attention_bias": False, "head_dim": 128, "hidden_act": "silu", "hidden_size": 5120,
        "intermediate_size": 25600, "model_type": "qwen3_vl_text", "num_attention_heads": 64,
        "num_hidden_layers": 64, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
        "rope_scaling": {"mrope_interleaved": True, "mrope_section": [24, 20, 20], "rope_type": "default"},
        "rope_theta": 5000000, "vocab_size": 151936,
    },
    "vision_config": {"depth": 27, "hidden_size": 1152},
}

EXPECTED_32B = {
    "vocab_size": 151936, "hidden_size": 5120, "num_layers": 64, "num_heads": 64, "num_kv_heads": 8,
    "head_dim": 128, "intermediate_size": 25600, "rms_norm_eps": 1e-6, "attention_bias": False,
    "rope_theta": 5e6,
}


MROPE = {"mrope_section": (24, 20, 20)}


def test_qwen3_vl_transformers_4_layout():
    assert text_fields(QWEN3_VL_32B_V4, WHERE) == EXPECTED_32B | MROPE | {"mrope_interleaved": True}


def test_qwen3_vl_transformers_5_layout():
    text = dict(QWEN3_VL_32B_V4["text_config"])
    del text["rope_theta"], text["rope_scaling"]
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": 5e6, "mrope_section": [24, 20, 20]}
    assert text_fields({**QWEN3_VL_32B_V4, "text_config": text}, WHERE) == EXPECTED_32B | MROPE


def test_the_official_vision_config():
    """MiniMax-AI/MiniMax-H3 FL2VA/text_encoder/config.json's vision_config (transformers 4.57)."""
    from h3core.text.config import Qwen3VisionConfig, mrope_sections, vision_fields

    official = {"vision_config": {
        "deepstack_visual_indexes": [8, 16, 24], "depth": 27, "hidden_act": "gelu_pytorch_tanh", "hidden_size": 1152,
        "in_channels": 3, "initializer_range": 0.02, "intermediate_size": 4304, "model_type": "qwen3_vl", "num_heads": 16,
        "num_position_embeddings": 2304, "out_hidden_size": 5120, "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2,
    }}
    config = Qwen3VisionConfig(**vision_fields(official, WHERE))
    assert (config.head_dim, config.grid_side, config.deepstack_visual_indexes, config.rope_theta) == (72, 48, (8, 16, 24), 10_000.0)
    text = merge_config(text_fields(QWEN3_VL_32B_V4, WHERE), {}, stated_in="config.json", defaults={})
    assert mrope_sections(text) == (24, 20, 20) and mrope_sections(text.model_copy(update={"mrope_section": None})) == (24, 20, 20)
    assert mrope_sections(text.model_copy(update={"mrope_section": None, "head_dim": 64})) is None
    assert vision_fields({}, WHERE) == {}


def test_plain_qwen3_top_level_fields():
    raw = {"model_type": "qwen3", **QWEN3_VL_32B_V4["text_config"], "rope_scaling": None, "rope_theta": 1e6}
    assert text_fields(raw, WHERE) == EXPECTED_32B | {"rope_theta": 1e6}


def test_config_fills_what_shapes_cannot_show():
    config = merge_config(EXPECTED_32B, {"hidden_size": 5120}, stated_in="config.json", defaults={"rope_theta": 1.0})
    assert config.rope_theta == 5e6 and config.num_kv_heads == 8


@pytest.mark.parametrize(
    "raw, match",
    [
        ({"model_type": "qwen3_moe"}, "'qwen3_moe' model"),
        ({"model_type": "qwen3", "hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"model_type": "qwen3", "use_sliding_window": True}, "sliding-window"),
        ({"model_type": "qwen3", "rope_scaling": {"type": "linear", "factor": 2.0}}, "RoPE type 'linear'"),
    ],
)
def test_unsupported_configs(raw, match):
    with pytest.raises(CheckpointError, match=match):
        text_fields(raw, WHERE)


def test_invalid_merged_config_is_one_line():
    fields = EXPECTED_32B | {"num_kv_heads": 7}
    with pytest.raises(CheckpointError, match="not a valid Qwen3 decoder") as caught:
        merge_config(fields, {}, stated_in="config.json", defaults={})
    assert "\n" not in str(caught.value)


def test_a_single_files_header_config_round_trips():
    from h3core.text.checkpoint import config_metadata
    from h3core.text.config import Qwen3TextConfig, read_metadata_config

    config = Qwen3TextConfig(**EXPECTED_32B)
    assert Qwen3TextConfig(**read_metadata_config(config_metadata(config.model_dump()), "f.safetensors")) == config
    with pytest.raises(CheckpointError, match="header's config is not JSON"):
        read_metadata_config("{", "f.safetensors")
