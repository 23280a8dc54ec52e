"""h3's decode equals the reference decode: diffusers 0.42.1's own MiniMax-H3 decode steps
(`MiniMaxH3VideoDecodeStep`, `MiniMaxH3AudioDecodeStep`: de-normalization from the VAE config,
`vae.decode` with its tiles and windows, the ImageNet pixel revert and clamp) run on diffusers'
model of the same weights, while h3 loads those weights from the Comfy file. fp32, relative
error <= 1e-5 (measured: 0, the same kernels on the same values)."""

from __future__ import annotations

import pytest
import torch

from h3core.decode.load import load_vae
from h3core.decode.run import decode_audio, decode_video
from h3core.decode.synthetic import synthetic_model, synthetic_vae_file
from h3core.decode.vae_files import find_vae_files
from h3core.reports.schema import error_between

TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def vaes(tmp_path_factory):
    cache = tmp_path_factory.mktemp("vae-cache")
    return {role: load_vae(find_vae_files(synthetic_vae_file(role, directory=cache)[0], role, "--test")) for role in ("video", "audio")}


@pytest.fixture(scope="module")
def reference():
    from diffusers.modular_pipelines.minimax_h3.decoders import MiniMaxH3AudioDecodeStep, MiniMaxH3VideoDecodeStep

    video = MiniMaxH3VideoDecodeStep().init_pipeline()
    video.update_components(vae=synthetic_model("video"))
    audio = MiniMaxH3AudioDecodeStep().init_pipeline()
    audio.update_components(audio_vae=synthetic_model("audio"))
    return {
        "video": lambda z: video(latents=z[None], output_type="pt").values["videos"][0].permute(1, 0, 2, 3),  # [F, 3, H, W] -> [3, F, H, W]
        "audio": lambda z: audio(audio_latents=z).values["audio"][0],  # [1, 2, samples] -> [2, samples]
    }


def _relative(ours: torch.Tensor, ref: torch.Tensor) -> float:
    max_abs, scale = error_between(ours, ref)
    return max_abs / scale


# (latent frames, latent height, latent width): one window; two windows cross-faded; 3 x 2 tiles of 256 px blended
@pytest.mark.parametrize("shape", [(7, 8, 16), (12, 4, 6), (7, 24, 18)], ids=["one-window", "two-windows", "tiled"])
def test_video_decode_equals_diffusers_decode_step(vaes, reference, shape):
    z = torch.randn(24, *shape, generator=torch.Generator().manual_seed(sum(shape)))
    ours = decode_video(vaes["video"], z)
    ref = reference["video"](z)
    assert ours.shape == ref.shape == (3, 17 * ((shape[0] - 2) // 5) + 5, 16 * shape[1], 16 * shape[2])
    assert _relative(ours, ref) <= TOLERANCE
    assert float(ours.min()) >= 0 and float(ours.max()) <= 1 and float(ours.std()) > 0.05  # a picture, not a constant


@pytest.mark.parametrize("latents", [37, 65])
def test_audio_decode_equals_diffusers_decode_step(vaes, reference, latents):
    z = torch.randn(2, 32, latents, generator=torch.Generator().manual_seed(latents))
    ours = decode_audio(vaes["audio"], z)
    ref = reference["audio"](z)
    assert ours.shape == ref.shape == (2, 800 * latents)
    assert _relative(ours, ref) <= TOLERANCE
    assert float(ours.abs().max()) <= 1 and 0.05 < float(ours.std()) < 0.9  # noise inside [-1, 1], not clipped flat
    assert not torch.equal(ours[0], ours[1])  # two channels, decoded separately


def test_the_denormalization_is_part_of_the_check(vaes, reference):
    """Decoding without z * std + mean would fail the comparison (the check can fail)."""
    z = torch.randn(24, 7, 8, 16, generator=torch.Generator().manual_seed(0))
    model = vaes["video"].model
    saved = (model.config.latents_mean, model.config.latents_std)
    try:
        model.register_to_config(latents_mean=[0.0] * 24, latents_std=[1.0] * 24)
        assert _relative(decode_video(vaes["video"], z), reference["video"](z)) > 1e-2
    finally:
        model.register_to_config(latents_mean=saved[0], latents_std=saved[1])
