"""H3's media clock (17n+5 frames, 5n+2 latents, round(F/24*40) audio latents, 800 samples each),
the latent checks' one-line errors, and the memory estimate's parameter counts against diffusers'
classes (real and synthetic sizes)."""

from __future__ import annotations

import pytest

from h3core.decode import geometry as g
from h3core.decode.memory import REAL_AUDIO, REAL_VIDEO, AudioDecoderSize, VideoDecoderSize, estimate_decode_memory, split_count
from h3core.decode.synthetic import CONFIGS
from h3core.errors import ConfigError


@pytest.mark.parametrize("frames, latents, audio", [(22, 7, 37), (124, 37, 207), (141, 42, 235), (192, 57, 320), (243, 72, 405)])
def test_frames_latents_and_audio_latents(frames, latents, audio):
    """The official shapes (MINIMAX_H3.md §2.5, §7: 124 -> 37 / 207, 192 -> 57 / 320, 243 -> 72 / 405)."""
    assert g.latent_frames(frames) == latents and g.frames_of(latents) == frames
    assert g.audio_latents(frames) == audio


def test_the_seed_clip():
    geometry = g.geometry_for(864, 480, 141)
    assert (geometry.latent_frames, geometry.audio_latents, geometry.decoded_samples, geometry.muxed_samples) == (42, 235, 188_000, 188_000)
    assert geometry.duration_s == 141 / 24


def test_the_waveform_is_cut_to_the_video_when_latents_overrun():
    geometry = g.geometry_for(256, 128, 22)  # 37 latents = 29,600 samples; 22 frames last 29,333
    assert (geometry.decoded_samples, geometry.muxed_samples) == (29_600, 29_333)


@pytest.mark.parametrize("frames", [0, 5, 21, 23, 140])
def test_a_frame_count_that_is_not_17n_plus_5(frames):
    with pytest.raises(ConfigError, match="is not 17n\\+5"):
        g.latent_frames(frames)


@pytest.mark.parametrize(
    "video, audio, needle",
    [
        ((16, 7, 8, 16), (2, 32, 37), r"the video latent has shape \[16, 7, 8, 16\]; H3's video VAE takes \[24, T, H/16, W/16\] \(24 channels\)"),
        ((24, 7, 8, 16), (2, 8, 37), r"the audio latent has shape \[2, 8, 37\]; H3's audio VAE takes \[2, 32, T_a\]"),
        ((24, 7, 8, 16), (32, 37), r"the audio latent has shape \[32, 37\]"),
        ((24, 8, 8, 16), (2, 32, 37), r"8 latent frames is not 5n\+2"),
        ((24, 7, 8, 16), (2, 32, 40), r"has 40 latents per channel, but 22 video frames .* go with round\(22 / 24 \* 40\) = 37"),
    ],
)
def test_latents_that_are_not_h3s_are_one_line(video, audio, needle):
    with pytest.raises(ConfigError, match=needle) as info:
        g.geometry_of(video, audio, "latents.safetensors")
    assert "\n" not in str(info.value) and str(info.value).startswith("latents.safetensors: ")


def _meta_parameters(role: str, config: dict) -> int:
    """Parameters of diffusers' decoder path (video: decoder + post_quant_conv; audio: dec_in_proj + decoder, weight norm folded)."""
    import torch

    from h3core.decode.audio_vae import fold_weight_norm
    from h3core.decode.load import build_model

    with torch.device("meta"):
        model = build_model(role, config)
    if role == "audio":
        fold_weight_norm(model)
        parts = ("dec_in_proj", "decoder")
    else:
        parts = ("post_quant_conv", "decoder")
    return sum(p.numel() for n, p in model.named_parameters() if n.split(".")[0] in parts)


def test_the_estimates_parameter_counts_are_diffusers():
    """The real sizes are diffusers' class defaults (the released config); the synthetic ones h3's."""
    assert REAL_VIDEO.parameters() == _meta_parameters("video", {})
    assert REAL_AUDIO.parameters() == _meta_parameters("audio", {})
    video, audio = VideoDecoderSize.of(CONFIGS["video"]), AudioDecoderSize.of(CONFIGS["audio"])
    assert video.parameters() == _meta_parameters("video", CONFIGS["video"])
    assert audio.parameters() == _meta_parameters("audio", CONFIGS["audio"])


def test_tiles_are_laid_out_as_diffusers_does():
    from diffusers import AutoencoderKLMiniMaxH3

    with __import__("torch").device("meta"):
        model = AutoencoderKLMiniMaxH3()
    for length in (128, 256, 480, 768, 864, 1344):
        starts, sizes, _ = model._split_tiles(length, 256, 64)
        assert split_count(length) == (len(starts), sizes[0])


def test_the_seed_settings_fit_one_gpu():
    estimate = estimate_decode_memory(864, 480, 141)
    assert (estimate.tiles_per_window, estimate.windows, estimate.tokens_per_tile) == (15, 8, 7 * 16 * 16 + 5)
    assert 9.9e9 < estimate.weights_bytes < 10.0e9  # 2.49 B float32 parameters
    assert estimate.total_bytes < 16 * 2**30
