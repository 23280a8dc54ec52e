"""H3's media clock, one place: frames, latent frames, audio latents and samples.

Facts (../shared/MINIMAX_H3.md §2.5, §6; diffusers 0.42.1 `modular_pipelines/minimax_h3/modular_pipeline.py`
`video_latent_num_frames` / `audio_latent_num_frames`, `AutoencoderKLMiniMaxH3._decode`): video at
24 fps, compressed 16x in space and causally in 17-frame chunks of which 5 latent frames are kept, so
`F = 17n + 5` frames are `T = 5n + 2` latent frames; audio at 40 latents per second per stereo
channel, 800 samples each at 32 kHz. The transformer's shapes (`h3core.model.config`) and the
decode (`h3core.decode.geometry`) both count with these. Torch-free.
"""

from __future__ import annotations

from h3core.errors import ConfigError

FPS = 24
"""Video frames per second (the official outputs and every reference)."""

SAMPLE_RATE = 32_000
"""The audio VAE's sample rate."""

AUDIO_LATENTS_PER_SECOND = 40
"""Audio latents per second per channel: 32 kHz / hop 800."""

SAMPLES_PER_AUDIO_LATENT = SAMPLE_RATE // AUDIO_LATENTS_PER_SECOND  # 800

AUDIO_STEREO = 2
"""Audio channels (the transformer packs them channel-major: row = channel * T_a + latent)."""

FRAMES_PER_CHUNK = 17
"""Pixel frames the video VAE encodes per chunk (its clip length)."""

LATENTS_PER_CHUNK = 5
"""Latent frames a chunk keeps (the VAE's token chunk size): F = 17n + 5 -> T = 5n + 2."""

SPATIAL_STRIDE = 16
"""Pixels per latent pixel on each spatial axis."""


def snap_frames(frames: int) -> int:
    """The smallest `17n + 5 >= frames` (the reference snaps a request up to what the VAE can encode)."""
    if frames < 1:
        raise ConfigError(f"frames must be at least 1, got {frames}")
    if frames <= LATENTS_PER_CHUNK:
        return LATENTS_PER_CHUNK
    n = -(-(frames - LATENTS_PER_CHUNK) // FRAMES_PER_CHUNK)
    return FRAMES_PER_CHUNK * n + LATENTS_PER_CHUNK


def latent_frames(frames: int) -> int:
    """Latent frames of `17n + 5` video frames: `5n + 2`."""
    if frames % FRAMES_PER_CHUNK != LATENTS_PER_CHUNK:
        raise ConfigError(f"{frames} frames is not of the form {FRAMES_PER_CHUNK}n + {LATENTS_PER_CHUNK}")
    return (frames - LATENTS_PER_CHUNK) // FRAMES_PER_CHUNK * LATENTS_PER_CHUNK + 2


def audio_latents(frames: int) -> int:
    """Audio latents per channel covering `frames` video frames: round(frames / 24 * 40)."""
    return int(round(frames / FPS * AUDIO_LATENTS_PER_SECOND))
