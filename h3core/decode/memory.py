"""How much memory decoding a (width, height, frames) video takes on each rank's device, before it runs.

For `h3 plan --memory` and the memory check: torch-free arithmetic over the decoders' sizes and the
decode as h3 runs it (`h3core.decode.spread`, `h3core.decode.tiles`), all in float32:

- weights: the video decoder (+ `post_quant_conv`) and the audio decoder (+ `dec_in_proj`), resident
  on every rank; the encoders are not loaded (`load_vae(decoder_only=True)`);
- video: the (window, tile) units shared out over the ranks; each unit is one tile of a 7-latent
  window through the ViT (tokens = 7 x tile latents + 5 suffix tokens; the block's live tensors,
  plus the attention scores if the backend materializes them), kept as its 22 used frames. A rank
  holds its own units until rank 0 has them; rank 0 holds the clip, one window of units (two when
  other ranks send theirs) and one unit through the ViT or a window's cross-fade;
- audio (the last rank): the BigVGAN stage with the most values (channels x samples), both stereo
  channels, times the tensors of that size held at once (measured, `AMP_LIVE_TENSORS`);
- on the CPU, the kernels' first-use buffers (`CPU_KERNEL_SCRATCH`).

The parameter counts are exact (tests compare them with diffusers' classes); the activation terms
are a model of the allocations checked against the CPU's measured peaks (docs/decode.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pydantic import BaseModel, Field

from h3core.decode.geometry import geometry_for
from h3core.media import FRAMES_PER_CHUNK, LATENTS_PER_CHUNK, SPATIAL_STRIDE

FLOAT_BYTES = 4
TILE_PX, TILE_OVERLAP_PX = 256, 64
"""The reference's decode tiles (diffusers' `tile_sample_min_*`, MiniMax `vae_tile_size` / `vae_tile_overlap_min`)."""
WINDOW_LATENTS = LATENTS_PER_CHUNK + 2
"""Latent frames per decode window: 5 plus the 2 the next window overlaps."""
WINDOW_FRAMES = 4 * WINDOW_LATENTS
KEPT_FRAMES = FRAMES_PER_CHUNK + 5
"""Frames of a decoded window the decode uses (its 17 and the 5 the next window cross-fades with)."""
FADE_FRAMES = 5
CPU_KERNEL_SCRATCH = 24 << 20
"""What the CPU's kernels allocate for themselves the first time a process decodes (oneDNN / MKL
scratch and caches): measured 22 MiB for the first unit of the synthetic VAE above a warm one
(78 against 56 MiB); counted on every rank of a CPU decode."""
AMP_LIVE_TENSORS = 48
"""Tensors of one stage's size (channels x samples, per stereo channel) the audio decode holds at its
peak. Measured on the CPU (synthetic audio VAE, 37 to 370 latents: 0.49 MiB per latent above the
loaded VAE, ~40 per channel): the anti-aliased activations work at twice the rate (padded, upsampled,
snake's sin and power, downsampled), and the CPU's dilated convolutions unfold their input (C x k x L
for kernels up to 11); 48 covers it with room."""


@dataclass(frozen=True)
class VideoDecoderSize:
    """The widths of a video VAE's ViT decoder (diffusers' config names)."""

    dim: int
    layers: int
    heads: int
    ffn_mult: int = 4
    registers: int = 4
    latent_channels: int = 24
    patch_values: int = 3 * 4 * 16 * 16

    @classmethod
    def of(cls, config: dict) -> "VideoDecoderSize":
        heads, head_dim = int(config["decoder_num_attention_heads"]), int(config.get("decoder_attention_head_dim", 64))
        return cls(
            dim=heads * head_dim, layers=int(config["decoder_num_layers"]), heads=heads, ffn_mult=int(config.get("decoder_ffn_mult", 4)),
            registers=int(config.get("decoder_num_register_tokens", 4)), latent_channels=int(config.get("latent_channels", 24)),
        )

    def parameters(self) -> int:
        """`decoder.*` plus `post_quant_conv.*`."""
        d, inner, c = self.dim, self.ffn_mult * self.dim, self.latent_channels
        block = 2 * d + 4 * (d * d + d) + 2 * d + (d * 2 * inner + 2 * inner) + (inner * d + d)
        return (c * d + d) + self.registers * d + self.layers * block + 2 * d + (d * self.patch_values + self.patch_values) + (c * c + c)


@dataclass(frozen=True)
class AudioDecoderSize:
    """The widths of an audio VAE's decoder: `dec_in_proj` (latent_channels -> latent_dim) and BigVGAN."""

    latent_dim: int
    decoder_dim: int
    latent_channels: int = 32
    rates: tuple[int, ...] = (5, 5, 2, 2, 2, 2, 2)
    kernels: tuple[int, ...] = (9, 9, 4, 4, 4, 4, 4)
    amp_kernels: tuple[int, ...] = (3, 7, 11)

    @classmethod
    def of(cls, config: dict) -> "AudioDecoderSize":
        return cls(latent_dim=int(config["latent_dim"]), decoder_dim=int(config["decoder_dim"]), latent_channels=int(config.get("latent_channels", 32)))

    def channels(self, stage: int) -> int:
        return self.decoder_dim // 2 ** (stage + 1)

    def parameters(self) -> int:
        """`dec_in_proj.*` plus `decoder.*`, weight norm folded."""
        total = self.latent_channels * self.latent_dim + self.latent_dim  # dec_in_proj
        total += self.latent_dim * self.decoder_dim * 7 + self.decoder_dim  # conv_pre
        for i, kernel in enumerate(self.kernels):
            c_in, c_out = self.decoder_dim // 2**i, self.channels(i)
            total += c_in * c_out * kernel + c_out
            for k in self.amp_kernels:  # an AMP block: 3 dilated + 3 plain convs, 6 SnakeBetas
                total += 6 * (c_out * c_out * k + c_out) + 6 * 2 * c_out
        last = self.channels(len(self.kernels) - 1)
        return total + 2 * last + last * 7  # activation_post, conv_post (no bias)

    def largest_stage_values(self, latents: int) -> int:
        """channels x samples of the largest stage, for one channel of audio."""
        length, most = latents, 0
        for i, rate in enumerate(self.rates):
            length *= rate
            most = max(most, self.channels(i) * length)
        return most


REAL_VIDEO = VideoDecoderSize(dim=2048, layers=36, heads=32)
REAL_AUDIO = AudioDecoderSize(latent_dim=2048, decoder_dim=1024)


class DecodeMemory(BaseModel):
    """Bytes a decode holds at its peak on each rank's device (float32)."""

    width: int
    height: int
    frames: int
    ranks: int = Field(1, description="Ranks the video's units are shared out over (`h3core.decode.spread`).")
    weights_bytes: int = Field(description="Both decoders, resident together on every rank.")
    scratch_bytes: int = Field(0, description="The CPU kernels' own first-use buffers (`CPU_KERNEL_SCRATCH`; 0 on CUDA).")
    video_activation_bytes: int = Field(description="Rank 0's video peak above its weights: the clip, a window of units (two when other ranks send theirs), one unit through the ViT or the window's cross-fade.")
    audio_activation_bytes: int = Field(description="The audio decode's peak above the weights (on the last rank).")
    rank_bytes: list[int] = Field(default_factory=list, description="Each rank's peak, weights included, rank 0 first.")
    total_bytes: int = Field(description="The largest rank's peak, weights included.")
    unit_bytes: int = Field(0, description="One unit's output as it is kept and sent: [3, 22, tile h, tile w].")
    tiles_per_window: int
    windows: int
    tokens_per_tile: int

    def activation_bytes(self) -> int:
        """The largest rank's peak above its weights."""
        return self.total_bytes - self.weights_bytes


def split_count(length_px: int, tile_px: int = TILE_PX, overlap_px: int = TILE_OVERLAP_PX) -> tuple[int, int]:
    """(tiles, tile length in px) along one axis, as diffusers' `_split_tiles` lays them out."""
    if tile_px >= length_px:
        return 1, length_px
    n = math.ceil(length_px / tile_px)
    while tile_px * n - overlap_px * (n - 1) < length_px:
        n += 1
    return n, tile_px


def estimate_decode_memory(
    width: int, height: int, frames: int, *, video: VideoDecoderSize = REAL_VIDEO, audio: AudioDecoderSize = REAL_AUDIO, ranks: int = 1,
    device: str = "cpu",
) -> DecodeMemory:
    """The decode of a `width` x `height`, `frames`-frame clip over `ranks` ranks on `device` (see the module docstring)."""
    from h3core.decode.tiles import shares

    geometry = geometry_for(width, height, frames)
    b = FLOAT_BYTES
    ny, tile_h = split_count(height)
    nx, tile_w = split_count(width)
    windows = (geometry.latent_frames - 2) // LATENTS_PER_CHUNK
    tokens = WINDOW_LATENTS * (tile_h // SPATIAL_STRIDE) * (tile_w // SPATIAL_STRIDE) + video.registers + 1
    inner = video.ffn_mult * video.dim
    per_tile = tokens * (6 * video.dim + 3 * inner + 2 * video.patch_values) * b + video.heads * tokens * tokens * b
    unit = 3 * KEPT_FRAMES * tile_h * tile_w * b
    latent = 24 * geometry.latent_frames * (height // SPATIAL_STRIDE) * (width // SPATIAL_STRIDE) * b
    clip = 3 * frames * width * height * b
    fade = 4 * 3 * FADE_FRAMES * width * height * b  # the faded frames, and the three temporaries of their blend
    window = ny * nx * unit
    rank0_video = latent + clip + window * (2 if ranks > 1 else 1) + max(per_tile, fade)
    audio_peak = 2 * AMP_LIVE_TENSORS * audio.largest_stage_values(geometry.audio_latents) * b
    audio_out = 2 * geometry.decoded_samples * b
    weights = (video.parameters() + audio.parameters()) * b
    per_rank = [rank0_video] + [latent + len(share) * unit + (per_tile if share else 0) for share in shares(windows * ny * nx, ranks)[1:]]
    if ranks == 1:  # the audio first, then held beside the video
        per_rank[-1] = max(audio_peak, per_rank[-1] + audio_out)
    else:  # the last rank: its units, sent and freed, then the audio
        per_rank[-1] = max(per_rank[-1], audio_peak + audio_out)
    scratch = CPU_KERNEL_SCRATCH if device == "cpu" else 0
    rank_bytes = [weights + scratch + p for p in per_rank]
    return DecodeMemory(
        width=width, height=height, frames=frames, ranks=ranks, weights_bytes=weights, scratch_bytes=scratch, video_activation_bytes=rank0_video,
        audio_activation_bytes=audio_peak, rank_bytes=rank_bytes, total_bytes=max(rank_bytes), unit_bytes=unit,
        tiles_per_window=ny * nx, windows=windows, tokens_per_tile=tokens,
    )
