"""The latents a decode takes and what they decode to: frames, latent frames, audio latents, samples
(counted with H3's media clock, `h3core.media`).

Facts (MINIMAX_H3.md §2.5, §6; diffusers 0.42.1 `modular_pipelines/minimax_h3/modular_pipeline.py`
`video_latent_num_frames` / `audio_latent_num_frames`, `AutoencoderKLMiniMaxH3._decode`):

- video: F = 17n + 5 frames at 24 fps <-> T = 5n + 2 latent frames (the VAE encodes 17-frame clips
  and drops 3 latent frames), 24 channels, H/16 x W/16;
- audio: T_a = round(F / 24 * 40) latents per stereo channel, 32 channels; the audio VAE gives 800
  samples per latent at 32 kHz, so the decoded waveform has 800 * T_a samples;
- the mp4 holds round(F / 24 * 32000) samples per channel (the video's duration; the waveform is
  cut or zero-padded by less than one latent, 25 ms, to it).

The latents h3 reads (`latents.safetensors`, what `h3 generate` writes) are in the transformer's
normalized latent space: `video` [24, T, H/16, W/16] and `audio` [2, 32, T_a], float32.

Torch-free: `h3 plan` and request checks use it.
"""

from __future__ import annotations

from typing import Sequence

from pydantic import BaseModel, Field

from h3core import media
from h3core.errors import ConfigError
from h3core.media import AUDIO_STEREO, FPS, FRAMES_PER_CHUNK, LATENTS_PER_CHUNK, SAMPLE_RATE, SAMPLES_PER_AUDIO_LATENT, SPATIAL_STRIDE, audio_latents

VIDEO_LATENT_CHANNELS = 24
AUDIO_LATENT_CHANNELS = 32

LATENT_DTYPES = ("F32", "F16", "BF16", "F64")
"""What a latent may be stored as (safetensors' names): a float of 16 bits or more. Checked before
anything is converted: cast to float first, an integer or boolean tensor would pass any later check."""


def check_latent_dtype(name: str, dtype: str, where: str) -> None:
    """The `name` latent's stored dtype `dtype` (safetensors' name, e.g. `I64`) is one a latent may be."""
    if dtype not in LATENT_DTYPES:
        raise ConfigError(
            f"{where}: the {name} latent is {dtype}, not a float tensor ({', '.join(LATENT_DTYPES)}); "
            "give the latents.safetensors of an h3 generate run"
        )


def latent_frames(frames: int) -> int:
    """17n + 5 frames -> 5n + 2 latent frames with n >= 1 (the VAE decodes no 2-frame latent); anything
    else is a ConfigError."""
    n, rest = divmod(frames - LATENTS_PER_CHUNK, FRAMES_PER_CHUNK)
    if n < 1 or rest:
        low = max(1, n)
        raise ConfigError(f"{frames} frames is not 17n+5 (n >= 1); H3 makes e.g. {17 * low + 5} or {17 * (low + 1) + 5} frames")
    return media.latent_frames(frames)


def frames_of(latent_frames: int) -> int:
    """5n + 2 latent frames -> 17n + 5 frames (n >= 1); anything else is a ConfigError."""
    n, rest = divmod(latent_frames - 2, LATENTS_PER_CHUNK)
    if latent_frames < 7 or rest:
        raise ConfigError(
            f"{latent_frames} latent frames is not 5n+2 (n >= 1): H3's video latents have 7, 12, 17, ... frames "
            "(17n+5 video frames)"
        )
    return FRAMES_PER_CHUNK * n + 5


def muxed_samples(frames: int) -> int:
    """Samples per channel in the mp4: the video's duration at 32 kHz, round(F / 24 * 32000)."""
    return round(frames * SAMPLE_RATE / FPS)


class LatentGeometry(BaseModel):
    """What a pair of H3 latents decodes to."""

    frames: int = Field(description="Video frames, 17n+5.")
    latent_frames: int = Field(description="Video latent frames T, 5n+2.")
    width: int = Field(description="Video width in pixels (16 x latent width).")
    height: int = Field(description="Video height in pixels (16 x latent height).")
    audio_latents: int = Field(description="Audio latents per stereo channel, round(F / 24 * 40).")
    decoded_samples: int = Field(description="Samples per channel the audio VAE gives: 800 x audio_latents.")
    muxed_samples: int = Field(description="Samples per channel in the mp4: round(F / 24 * 32000).")
    duration_s: float = Field(description="frames / 24.")

    def describe(self) -> str:
        return f"{self.width}x{self.height}, {self.frames} frames ({self.duration_s:.3f} s), {self.audio_latents} audio latents"


def geometry_of(video_shape: Sequence[int], audio_shape: Sequence[int], where: str) -> LatentGeometry:
    """Check a video latent [24, T, H/16, W/16] and an audio latent [2, 32, T_a] against H3's
    contract and each other; `where` names their source in the error line."""
    video_shape, audio_shape = tuple(video_shape), tuple(audio_shape)
    if len(video_shape) != 4 or video_shape[0] != VIDEO_LATENT_CHANNELS:
        raise ConfigError(
            f"{where}: the video latent has shape {list(video_shape)}; H3's video VAE takes "
            f"[{VIDEO_LATENT_CHANNELS}, T, H/16, W/16] (24 channels)"
        )
    if len(audio_shape) != 3 or audio_shape[:2] != (AUDIO_STEREO, AUDIO_LATENT_CHANNELS):
        raise ConfigError(
            f"{where}: the audio latent has shape {list(audio_shape)}; H3's audio VAE takes "
            f"[{AUDIO_STEREO}, {AUDIO_LATENT_CHANNELS}, T_a] (stereo, 32 channels)"
        )
    _, t, h, w = video_shape
    if h < 1 or w < 1:
        raise ConfigError(f"{where}: the video latent has shape {list(video_shape)}: no pixels to decode")
    try:
        frames = frames_of(t)
    except ConfigError as err:
        raise ConfigError(f"{where}: {err}") from None
    expected = audio_latents(frames)
    if audio_shape[2] != expected:
        raise ConfigError(
            f"{where}: the audio latent has {audio_shape[2]} latents per channel, but {frames} video frames "
            f"({t} latent frames) go with round({frames} / 24 * 40) = {expected}; the two latents are not one H3 clip"
        )
    return LatentGeometry(
        frames=frames, latent_frames=t, width=w * SPATIAL_STRIDE, height=h * SPATIAL_STRIDE, audio_latents=expected,
        decoded_samples=expected * SAMPLES_PER_AUDIO_LATENT, muxed_samples=muxed_samples(frames), duration_s=frames / FPS,
    )


def geometry_for(width: int, height: int, frames: int) -> LatentGeometry:
    """The geometry of a request (for estimates): pixel size and frame count checked, latents derived."""
    if width % SPATIAL_STRIDE or height % SPATIAL_STRIDE or width < SPATIAL_STRIDE or height < SPATIAL_STRIDE:
        raise ConfigError(f"{width}x{height} is not a multiple of {SPATIAL_STRIDE} pixels per side; the video VAE needs one")
    t = latent_frames(frames)
    return geometry_of((VIDEO_LATENT_CHANNELS, t, height // SPATIAL_STRIDE, width // SPATIAL_STRIDE), (AUDIO_STEREO, AUDIO_LATENT_CHANNELS, audio_latents(frames)), "request")
