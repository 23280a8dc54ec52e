import pytest

from h3core.errors import ConfigError
from h3core.model.config import PRESETS, ModelConfig, preset
from h3core.model.sequence import SegmentKind as K


def test_h3_token_count_at_the_reference_resolution():
    cfg = preset("h3")
    assert cfg.hidden == 7168
    assert cfg.video_latent_shape(864, 480, 141) == (48, 36, 30, 54)
    assert cfg.video_grid(864, 480, 141) == (36, 15, 27)
    assert cfg.audio_latent_shape(141) == (64, 147)
    segs = cfg.segments(864, 480, 141, 128)
    assert [(s.kind, len(s)) for s in segs] == [(K.TEXT, 128), (K.VIDEO, 14580), (K.AUDIO, 147)]
    assert cfg.num_tokens(864, 480, 141, 128) == 14855


def test_narrow_default_tokens_divide_by_no_target_count():
    cfg = preset("narrow")
    n = cfg.num_tokens(cfg.width, cfg.height, cfg.frames, cfg.text_tokens)
    assert n == 147
    assert all(n % w for w in (2, 4, 6, 8))
    assert cfg.num_heads == 56


@pytest.mark.parametrize("w, h, f, match", [(860, 480, 141, "multiple of 32"), (864, 480, 140, "4k\\+1; try 137")])
def test_bad_sizes_say_what_to_use(w, h, f, match):
    with pytest.raises(ConfigError, match=match):
        preset("h3").video_latent_shape(w, h, f)


def test_unknown_preset():
    with pytest.raises(ConfigError, match="choose one of: h3, h3-2blocks, narrow, narrow-1k, wide-1k, tiny"):
        preset("huge")


def test_presets_are_valid_and_head_dim_is_block_aligned():
    for cfg in PRESETS.values():
        assert cfg.head_dim % 16 == 0 and cfg.mlp_width % 16 == 0
        assert sum(cfg.rope_axes) == cfg.head_dim
    with pytest.raises(ValueError):
        ModelConfig(**{**PRESETS["tiny"].model_dump(), "head_dim": 24})
