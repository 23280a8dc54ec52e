"""Keyframe latents (FL2VA): each prepared keyframe through the video VAE's encoder, as the reference
encodes it (../shared/MINIMAX_H3.md §3.4-3.5, §6.1; diffusers 0.42.1 `encoders.encode_vae_condition`,
SGLang `keyframe_encoding.py`).

    vae = load_keyframe_encoder(files, device)          # the encoder and quant_conv alone, float32
    latents = encode_keyframes(vae, images)             # [24, n, H/16, W/16] float32 CPU, normalized
    release_keyframe_encoder(vae)                       # before the denoiser's peak

Per keyframe (a uint8 RGB image already on the canvas, `h3core.keyframes.prepare_keyframes`):
pixels / 255, ImageNet mean/std; diffusers' `AutoencoderKLMiniMaxH3.encode` (a single frame takes the
spatial encoder alone, tiled as the reference tiles it); the posterior SAMPLED with a fresh CPU
generator seeded 42 (the same anchor for the same keyframe, whatever the request's seed: diffusers'
`keyframe_encode_seed`); rounded to float16; `(z - latents_mean) / latents_std` with the VAE's own
statistics. The model is diffusers' class (h3 only loads it: `h3core.decode.load`), so the encode is
the reference's by construction; what h3 owns is the recipe around it.

SGLang seeds the *global* RNG of the device the VAE runs on; on a GPU that is CUDA's generator, so
the official server's keyframe latents on a GPU are not the ones a CPU generator draws. h3 (both
noise recipes) draws the posterior sample on a CPU generator, as diffusers does: the same latents on
every device.
"""

from __future__ import annotations

import gc
from typing import TYPE_CHECKING, Sequence

import torch

if TYPE_CHECKING:
    from PIL import Image

    from h3core.decode.load import LoadedVae
    from h3core.decode.vae_files import VaeFiles

PIXEL_MEAN = (0.485, 0.456, 0.406)
PIXEL_STD = (0.229, 0.224, 0.225)
"""The video VAE's pixel convention (ImageNet's), diffusers' `pixel_mean` / `pixel_std`."""
ENCODE_SEED = 42
"""The posterior of every keyframe is sampled under a CPU generator seeded with this (diffusers' `keyframe_encode_seed`)."""


def load_keyframe_encoder(files: "VaeFiles", device: torch.device | str = "cpu") -> "LoadedVae":
    """The video VAE of `files` with its encoder and `quant_conv` only (float32 on `device`)."""
    from h3core.decode.load import load_vae

    return load_vae(files, device, encoder_only=True)


def pixels_of(image: "Image.Image", device: torch.device | str = "cpu") -> torch.Tensor:
    """An RGB image as the encoder takes it: `[1, 3, 1, H, W]` float32, `(x / 255 - mean) / std`."""
    import numpy as np

    if image.mode != "RGB":
        raise ValueError(f"a keyframe reaches the VAE as RGB, got mode {image.mode}")
    x = torch.from_numpy(np.array(image)).to(device).permute(2, 0, 1)[None, :, None]  # [1, 3, 1, H, W] uint8
    mean = torch.tensor(PIXEL_MEAN, device=x.device).view(1, -1, 1, 1, 1)
    std = torch.tensor(PIXEL_STD, device=x.device).view(1, -1, 1, 1, 1)
    return (x.to(torch.float32).div(255.0) - mean) / std


@torch.inference_mode()
def encode_keyframe(vae: "LoadedVae", image: "Image.Image") -> torch.Tensor:
    """One keyframe's normalized latent frame: `[24, 1, H/16, W/16]` float32 on the CPU."""
    model = vae.model
    posterior = model.encode(pixels_of(image, vae.device), return_dict=False)[0]
    z = posterior.sample(generator=torch.Generator().manual_seed(ENCODE_SEED))  # [1, 24, 1, h, w]
    z = z.to(torch.float16).float().cpu()
    mean = torch.tensor(model.config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(model.config.latents_std).view(1, -1, 1, 1, 1)
    return ((z - mean) / std)[0]


def encode_keyframes(vae: "LoadedVae", images: Sequence["Image.Image"]) -> torch.Tensor:
    """The keyframes' normalized latents in packed order: `[24, n, H/16, W/16]` float32 on the CPU."""
    sizes = {image.size for image in images}
    if len(sizes) != 1:
        raise ValueError(f"keyframes reach the VAE on one canvas, got sizes {sorted(sizes)}")
    return torch.cat([encode_keyframe(vae, image) for image in images], dim=1)


def release_keyframe_encoder(vae: "LoadedVae") -> None:
    """Drop the encoder's weights before the denoiser loads (on a GPU: collected and the CUDA cache
    emptied; on the CPU the references going is enough, and a full collection costs seconds in a
    process holding many objects)."""
    device = vae.device
    vae.model = None  # type: ignore[assignment]
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()
