"""A keyframe's latent as h3 encodes it equals diffusers' `encode_vae_condition` on the same VAE, from
every layout h3 reads; the encoder loads without the decoder; condition rows and their noise."""

from __future__ import annotations

import json

import pytest
import torch

from h3core.decode.load import load_vae
from h3core.decode.synthetic import CONFIGS, comfy_tensors, synthetic_model, write_comfy_file
from h3core.decode.vae_files import find_vae_files
from h3core.files.safetensors import write_safetensors
from h3core.keyframes.latents import PIXEL_MEAN, PIXEL_STD, encode_keyframes, load_keyframe_encoder

SEED = 5


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """The same random video VAE as a Comfy file, a diffusers folder and MiniMax's folder; and the model."""
    model = synthetic_model("video", SEED)
    root = tmp_path_factory.mktemp("keyframe-vae")
    paths = {"comfy": write_comfy_file(root / "vae.safetensors", "video", model.state_dict(), CONFIGS["video"], {})}
    model.save_pretrained(root / "vae")
    paths["diffusers"] = root / "vae"
    minimax = root / "video_vae"
    (minimax / "source").mkdir(parents=True)
    tensors = comfy_tensors("video", model.state_dict(), CONFIGS["video"])
    write_safetensors(minimax / "source" / "model.safetensors", {k: v for k, v in tensors.items() if not k.startswith("latents_")})
    (minimax / "config.json").write_text(json.dumps({
        "_class_name": "MiniMaxH3VideoVAE", "source_path": "source", "source_safetensors_path": "model.safetensors",
        "latents_mean": CONFIGS["video"]["latents_mean"], "latents_std": CONFIGS["video"]["latents_std"],
    }))
    paths["minimax"] = minimax
    return model, paths


def _images(width: int, height: int, count: int):
    from PIL import Image

    generator = torch.Generator().manual_seed(3)
    return [Image.fromarray(torch.randint(0, 256, (height, width, 3), generator=generator, dtype=torch.uint8).numpy(), "RGB") for _ in range(count)]


@pytest.mark.parametrize("layout", ["comfy", "diffusers", "minimax"])
def test_keyframe_latents_equal_diffusers_encode(written, layout):
    import numpy as np
    from diffusers.modular_pipelines.minimax_h3.encoders import encode_vae_condition

    model, paths = written
    vae = load_keyframe_encoder(find_vae_files(paths[layout], "video", "--video-vae"))
    images = _images(96, 64, 2)  # (one tile: the tiling is diffusers' own code, run as it is)
    ours = encode_keyframes(vae, images)
    assert ours.shape == (24, 2, 4, 6) and ours.dtype == torch.float32
    with torch.inference_mode():
        expected = [encode_vae_condition(model, torch.from_numpy(np.array(im)).permute(2, 0, 1)[None, :, None], PIXEL_MEAN, PIXEL_STD, 42)[0] for im in images]
    assert torch.equal(ours, torch.cat(expected, dim=1))
    assert torch.isfinite(ours).all()
    assert not torch.equal(ours[:, 0], ours[:, 1])  # two images, two latents


def test_the_encoder_loads_without_the_decoder(written):
    _, paths = written
    files = find_vae_files(paths["comfy"], "video", "--video-vae")
    encoder = load_vae(files, encoder_only=True).model
    whole = load_vae(files, decoder_only=False).model
    assert encoder.decoder is None and encoder.post_quant_conv is None
    kept = encoder.state_dict()
    assert kept and all(k.startswith(("encoder.", "quant_conv.")) for k in kept)
    assert all(torch.equal(v, whole.state_dict()[k]) for k, v in kept.items())
    assert sum(p.numel() for p in encoder.parameters()) < sum(p.numel() for p in whole.parameters())
