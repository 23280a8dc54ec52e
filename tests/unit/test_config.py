import pytest

from h3core.errors import ConfigError
from h3core.model.config import PRESETS, ModelConfig, preset
from h3core.model.sequence import SegmentKind as K


def test_h3_rows_at_the_seeds_resolution():
    """864x480, 141 frames: 42 latent frames of 15 x 27 patches, 235 audio latents per channel."""
    cfg = preset("h3")
    assert (cfg.hidden, cfg.attention_width, cfg.ffn_dim, cfg.rotary_dim) == (5376, 7168, 14336, 96)
    shape = cfg.video_shape(864, 480, 141)
    assert shape.video_latent == (24, 42, 30, 54) and shape.audio_latent == (2, 32, 235) and shape.grid == (42, 15, 27)
    segs = cfg.segments(864, 480, 141, 128)
    assert [(s.kind, len(s)) for s in segs] == [(K.TEXT, 128), (K.AUDIO, 470), (K.VIDEO, 17_010)]
    assert cfg.num_tokens(864, 480, 141, 128) == 17_608
    assert cfg.num_tokens(1344, 768, 243, 0) == 73_386  # the official 16:9, 10 s request: L + 73,386


def test_narrow_keeps_h3s_56_heads_and_a_residual_width_of_its_own():
    cfg = preset("narrow")
    assert cfg.num_heads == 56 and cfg.hidden != cfg.attention_width
    assert cfg.num_tokens(cfg.width, cfg.height, cfg.frames, 0) == 74 + 84


@pytest.mark.parametrize("w, h, f, match", [(860, 480, 141, "multiple of 32 pixels on both axes.*try 864x480"),
                                            (864, 96, 141, "aspect ratio of 9; H3 takes 1:4 to 4:1")])
def test_bad_sizes_say_what_to_use(w, h, f, match):
    with pytest.raises(ConfigError, match=match):
        preset("h3").video_shape(w, h, f)


def test_a_prompt_longer_than_h3_takes_is_refused_not_truncated():
    cfg = preset("tiny")
    with pytest.raises(ConfigError, match="never truncates"):
        cfg.segments(cfg.width, cfg.height, cfg.frames, cfg.max_text_tokens + 1)


def test_unknown_preset():
    with pytest.raises(ConfigError, match="choose one of: h3, h3-2blocks, narrow, narrow-1k, wide-1k, tiny"):
        preset("huge")


def test_presets_are_valid_and_widths_block_aligned():
    for cfg in PRESETS.values():
        assert cfg.head_dim % 16 == 0 and cfg.ffn_dim % 16 == 0 and cfg.hidden % 16 == 0
        assert cfg.rotary_dim <= cfg.head_dim and cfg.hidden != cfg.attention_width and cfg.pruned
        assert (cfg.video_channels, cfg.audio_channels) == (24, 32)  # the real latent spaces, so the real VAEs decode them
    with pytest.raises(ValueError):
        ModelConfig(**{**PRESETS["tiny"].model_dump(), "head_dim": 24})
    with pytest.raises(ValueError, match="rotates 24 channels, more than head_dim 16"):
        ModelConfig(**{**PRESETS["tiny"].model_dump(), "rope_freq_dim": 4})
