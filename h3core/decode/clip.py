"""A decoded clip and the two decodes' pieces: de-normalizing, diffusers' one-call decodes (the
reference), the pixel revert, the latents' check. Shared by the one-device decode (`h3core.decode.run`)
and the decode spread over ranks (`h3core.decode.spread`), which both build on it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Mapping

from h3core.decode.geometry import LatentGeometry, check_latent_dtype, geometry_of
from h3core.errors import ConfigError

if TYPE_CHECKING:
    import torch

    from h3core.decode.load import LoadedVae

PIXEL_MEAN = (0.485, 0.456, 0.406)
PIXEL_STD = (0.229, 0.224, 0.225)
"""ImageNet's: the video VAE's pixel space (diffusers' `MiniMaxH3ModularPipeline.pixel_mean/std`)."""
Phase = Callable[[str], None]


def no_phase(phase: str) -> None:
    """A `Phase` callback that says nothing."""
    pass


# --- the two decodes ----------------------------------------------------------------------------------


def _stats(model: "torch.nn.Module", shape: tuple[int, ...], device: "torch.device") -> tuple["torch.Tensor", "torch.Tensor"]:
    import torch

    mean = torch.tensor(model.config.latents_mean, device=device).view(shape)
    std = torch.tensor(model.config.latents_std, device=device).view(shape)
    return mean, std


def denormalized_video(vae: "LoadedVae", latent: "torch.Tensor") -> "torch.Tensor":
    """Normalized video latent [24, T, h, w] -> what the VAE decodes: [1, 24, T, h, w] = z * std + mean (float32, on the VAE's device)."""
    import torch

    mean, std = _stats(vae.model, (1, -1, 1, 1, 1), vae.device)
    return latent.to(device=vae.device, dtype=torch.float32)[None] * std + mean


def to_pixels(video: "torch.Tensor") -> "torch.Tensor":
    """The VAE's ImageNet-normalized output [3, F, H, W] -> pixels in [0, 1], in place."""
    import torch

    pixel_mean = torch.tensor(PIXEL_MEAN, device=video.device).view(-1, 1, 1, 1)
    pixel_std = torch.tensor(PIXEL_STD, device=video.device).view(-1, 1, 1, 1)
    return video.mul_(pixel_std).add_(pixel_mean).clamp_(0, 1)


def decode_video(vae: "LoadedVae", latent: "torch.Tensor") -> "torch.Tensor":
    """Normalized video latent [24, T, H/16, W/16] -> frames [3, F, H, W] in [0, 1] (float32, on the
    VAE's device) by diffusers' `decode` in one call: the reference the shared-out decode
    (`h3core.decode.spread`) equals bit for bit."""
    import torch

    with torch.inference_mode():
        z = denormalized_video(vae, latent)  # [1, 24, T, h, w]
        return to_pixels(vae.model.decode(z, return_dict=False)[0].float()[0])  # [3, F, H, W], ImageNet-normalized first


def decode_audio(vae: "LoadedVae", latent: "torch.Tensor") -> "torch.Tensor":
    """Normalized audio latent [2, 32, T_a] -> stereo waveform [2, 800 * T_a] in [-1, 1] (float32, on the VAE's device)."""
    import torch

    device = vae.device
    mean, std = _stats(vae.model, (1, -1, 1), device)
    with torch.inference_mode():
        z = latent.to(device=device, dtype=torch.float32) * std + mean  # [2, 32, T_a]: the channels as a batch
        return vae.model.decode(z, return_dict=False)[0].float()[:, 0]  # [2, 1, samples] -> [2, samples]


@dataclass
class Decoded:
    """A decoded clip, on the CPU."""

    geometry: LatentGeometry
    video: "torch.Tensor"
    """[3, F, H, W] float32 in [0, 1]."""
    audio: "torch.Tensor"
    """[2, 800 * T_a] float32 in [-1, 1] (the VAE's whole output)."""
    seconds: dict[str, float]

    def frames_uint8(self) -> "torch.Tensor":
        """[F, H, W, 3] uint8 = round(x * 255): what the encoder gets."""
        import torch

        return (self.video * 255).round_().to(torch.uint8).permute(1, 2, 3, 0).contiguous()

    def muxed_audio(self) -> "torch.Tensor":
        """[2, round(F / 24 * 32000)]: the waveform cut (or zero-padded) to the video's duration."""
        import torch.nn.functional as F

        wanted = self.geometry.muxed_samples
        audio = self.audio[:, :wanted]
        return F.pad(audio, (0, wanted - audio.shape[1])) if audio.shape[1] < wanted else audio


def _stored_names() -> dict:
    """safetensors' name of each torch dtype a latent may be (`LATENT_DTYPES`)."""
    import torch

    return {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64"}


def check_latents(latents: Mapping[str, "torch.Tensor"], where: str) -> LatentGeometry:
    """The latents are H3's pair (shapes, channel counts, lengths that agree) and finite."""
    import torch

    missing = [k for k in ("video", "audio") if latents.get(k) is None]
    if missing:
        raise ConfigError(f"{where} has no {' and no '.join(repr(k) for k in missing)} latent; it needs 'video' [24, T, H/16, W/16] and 'audio' [2, 32, T_a]")
    stored = _stored_names()
    for name in ("video", "audio"):
        check_latent_dtype(name, stored.get(latents[name].dtype, str(latents[name].dtype).removeprefix("torch.")), where)
    geometry = geometry_of(latents["video"].shape, latents["audio"].shape, where)
    for name in ("video", "audio"):
        if not bool(torch.isfinite(latents[name]).all()):
            raise ConfigError(f"{where}: the {name} latent holds NaN or infinite values; it cannot be decoded")
    return geometry
