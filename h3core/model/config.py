"""Model dimensions and named presets, plus the latent/patch arithmetic that turns a video request
(width, height, frames) into packed-sequence token counts.

Latent arithmetic (the contract `h3 plan`, the model and the checkpoint share):

- Video VAE: 4x temporal, 16x spatial compression, causal in time, so `frames = 4k + 1` gives
  `T = (frames - 1) / 4 + 1` latent frames of `height/16 x width/16`, `video_channels` deep.
- Video patchify `(1, 2, 2)`: `T x (height/32) x (width/32)` tokens of `video_channels*4` features.
  Width and height must therefore be multiples of 32.
- Audio: a latent at `audio_latent_hz` frames per second of video time; the video runs at `fps`,
  so `L = ceil(frames * audio_latent_hz / fps)` latent frames, patchified `audio_patch` at a time.
- Text: one token per prompt token (no padding), at most `max_text_tokens`.

H3 at 864x480, 141 frames: T = 36, 15 x 27 patches per frame -> 14,580 video tokens;
ceil(141 * 25 / 24) = 147 audio tokens; with a 128-token prompt the packed sequence is 14,855.

Pure pydantic, no torch (`h3core.model.sequence` imports torch only for its tensor helpers): `h3 plan` and the partition checks use it before any heavy import.
"""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict, Field, model_validator

from h3core.errors import ConfigError
from h3core.model.sequence import Segment, SegmentKind, pack_segments
from h3core.nvfp4 import layout


class ModelConfig(BaseModel):
    """Dimensions of the H3 denoiser and the defaults of a run that suit them."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(description="Preset name, or 'checkpoint' when read from a file.")
    num_heads: int = Field(gt=0, description="Attention heads (H3: 56).")
    head_dim: int = Field(gt=0, description="Width of one head (H3: 128); a multiple of 16.")
    num_blocks: int = Field(gt=0, description="Transformer blocks (H3: 50).")
    mlp_width: int = Field(gt=0, description="SwiGLU hidden width F: FC1 is [2F, D], FC2 is [D, F].")
    text_dim: int = Field(gt=0, description="Width of the text encoder's hidden states.")
    video_channels: int = Field(gt=0, description="Channels of the video latent.")
    audio_channels: int = Field(gt=0, description="Channels of the audio latent.")
    video_patch: tuple[int, int, int] = Field((1, 2, 2), description="Patch (t, h, w) of the video latent.")
    audio_patch: int = Field(1, gt=0, description="Audio latent frames per token.")
    vae_time_stride: int = Field(4, gt=0, description="Video frames per latent frame (after the first).")
    vae_space_stride: int = Field(16, gt=0, description="Pixels per latent pixel, each spatial axis.")
    fps: int = Field(24, gt=0, description="Video frame rate.")
    audio_latent_hz: int = Field(25, gt=0, description="Audio latent frames per second.")
    time_embed_dim: int = Field(256, gt=0, description="Width of the sinusoidal timestep embedding.")
    rope_theta: float = Field(10000.0, gt=0, description="RoPE base.")
    norm_eps: float = Field(1e-6, gt=0, description="Epsilon of LayerNorm and RMSNorm.")
    max_text_tokens: int = Field(512, gt=0, description="Longest prompt kept (tokens beyond are dropped).")
    # Defaults of a run with this preset.
    width: int = Field(gt=0, description="Default video width in pixels.")
    height: int = Field(gt=0, description="Default video height in pixels.")
    frames: int = Field(gt=0, description="Default number of video frames.")
    steps: int = Field(gt=0, description="Default denoising steps.")
    text_tokens: int = Field(gt=0, description="Prompt length assumed when planning without a prompt.")
    shift: float = Field(5.0, gt=0, description="Flow-matching sigma shift of the sampler.")

    @model_validator(mode="after")
    def _check(self) -> "ModelConfig":
        if not layout.is_block_aligned(self.head_dim):
            raise ValueError(f"head_dim {self.head_dim} must be a multiple of {layout.BLOCK_ELEMENTS} (NVFP4 blocks follow heads)")
        if not layout.is_block_aligned(self.mlp_width):
            raise ValueError(f"mlp_width {self.mlp_width} must be a multiple of {layout.BLOCK_ELEMENTS} (NVFP4 blocks)")
        if self.head_dim % 2 or min(self.rope_axes) <= 0:
            raise ValueError(f"head_dim {self.head_dim} too small for 3-axis RoPE")
        return self

    @property
    def hidden(self) -> int:
        """Model width D = heads x head_dim."""
        return self.num_heads * self.head_dim

    @property
    def rope_axes(self) -> tuple[int, int, int]:
        """Head-dim split between the (t, h, w) RoPE axes; each part even. 128 -> (44, 42, 42)."""
        side = 2 * (self.head_dim // 6)
        return (self.head_dim - 2 * side, side, side)

    @property
    def video_patch_dim(self) -> int:
        pt, ph, pw = self.video_patch
        return self.video_channels * pt * ph * pw

    @property
    def audio_patch_dim(self) -> int:
        return self.audio_channels * self.audio_patch

    # --- latent arithmetic ---------------------------------------------------------------------

    def video_latent_shape(self, width: int, height: int, frames: int) -> tuple[int, int, int, int]:
        """`[C, T, H, W]` of the video latent for a request; raises on sizes the VAE cannot take."""
        pt, ph, pw = self.video_patch
        px_h, px_w = self.vae_space_stride * ph, self.vae_space_stride * pw
        if width <= 0 or height <= 0 or width % px_w or height % px_h:
            raise ConfigError(
                f"{width}x{height} is not a multiple of {px_w}x{px_h} pixels "
                f"(VAE {self.vae_space_stride}x and patch {ph}x{pw}); try e.g. "
                f"{max(px_w, width // px_w * px_w)}x{max(px_h, height // px_h * px_h)}"
            )
        if frames < 1 or (frames - 1) % self.vae_time_stride:
            k = max(0, (frames - 1) // self.vae_time_stride)
            raise ConfigError(
                f"{frames} frames is not {self.vae_time_stride}k+1; try {self.vae_time_stride * k + 1}"
            )
        t = (frames - 1) // self.vae_time_stride + 1
        if t % pt:
            raise ConfigError(f"{t} latent frames do not divide by the temporal patch {pt}")
        return (self.video_channels, t, height // self.vae_space_stride, width // self.vae_space_stride)

    def video_grid(self, width: int, height: int, frames: int) -> tuple[int, int, int]:
        """Token grid `(t, h, w)` of the patchified video latent."""
        _, t, h, w = self.video_latent_shape(width, height, frames)
        pt, ph, pw = self.video_patch
        return (t // pt, h // ph, w // pw)

    def audio_latent_shape(self, frames: int) -> tuple[int, int]:
        """`[C, L]` of the audio latent covering the video's duration (rounded up to whole patches)."""
        length = math.ceil(frames * self.audio_latent_hz / self.fps)
        length = math.ceil(length / self.audio_patch) * self.audio_patch
        return (self.audio_channels, length)

    def segments(self, width: int, height: int, frames: int, text_tokens: int) -> list[Segment]:
        """The packed `text | video | audio` layout of one run."""
        if not 0 <= text_tokens <= self.max_text_tokens:
            raise ConfigError(f"text length {text_tokens} is outside 0..{self.max_text_tokens}")
        t, h, w = self.video_grid(width, height, frames)
        audio_tokens = self.audio_latent_shape(frames)[1] // self.audio_patch
        return pack_segments(
            [(SegmentKind.TEXT, text_tokens), (SegmentKind.VIDEO, t * h * w), (SegmentKind.AUDIO, audio_tokens)]
        )

    def num_tokens(self, width: int, height: int, frames: int, text_tokens: int) -> int:
        """Length of the packed sequence of one run."""
        return self.segments(width, height, frames, text_tokens)[-1].stop


_NARROW = ModelConfig(
    name="narrow", num_heads=56, head_dim=16, num_blocks=2, mlp_width=1184, text_dim=64,
    video_channels=4, audio_channels=4, max_text_tokens=64,
    width=256, height=160, frames=9, steps=4, text_tokens=17,
)
_NARROW_1K = _NARROW.model_copy(update={"name": "narrow-1k", "width": 448, "height": 320, "frames": 25})

PRESETS: dict[str, ModelConfig] = {
    # The real model. mlp_width 10752 (= 1.5 x 7168) is inferred from the checkpoint's size;
    # see docs/checkpoint.md for the arithmetic.
    "h3": ModelConfig(
        name="h3", num_heads=56, head_dim=128, num_blocks=50, mlp_width=10752, text_dim=5120,
        video_channels=48, audio_channels=64,
        width=864, height=480, frames=141, steps=12, text_tokens=128,
    ),
    # The real widths, sequence and resolution with 2 of the 50 blocks: per-block time and memory
    # on a GPU without the 12.5 GB checkpoint (its synthetic checkpoint is about 0.7 GB).
    "h3-2blocks": ModelConfig(
        name="h3-2blocks", num_heads=56, head_dim=128, num_blocks=2, mlp_width=10752, text_dim=5120,
        video_channels=48, audio_channels=64,
        width=864, height=480, frames=141, steps=12, text_tokens=128,
    ),
    # The real 56 heads on a narrow width: ragged heads (56 over 6) and ragged NVFP4 blocks
    # (74 over 6) on a CPU. Its default token count, 120 video + 10 audio + 17 text = 147,
    # divides by none of 2, 4, 6, 8.
    "narrow": _NARROW,
    # narrow's model on a ~1,000-token sequence (980 video + 27 audio + the prompt): one denoising
    # step takes about 1-2 s on one CPU thread, enough compute per step for rank scaling to show on
    # CPU ranks (narrow's 194 tokens measure overheads only). 56 heads keep partitions ragged.
    "narrow-1k": _NARROW_1K,
    # H3's 56 heads at head width 32 (hidden 1792) and a 169-block MLP (2704: ragged over every
    # count) on narrow-1k's ~1,070 tokens: about 2 s per denoising step on one CPU thread, so that
    # 2 ranks x 1 thread vs 1 rank x 1 thread measures scaling, not overheads (scripts/bench_distributed.py).
    "wide-1k": _NARROW_1K.model_copy(update={"name": "wide-1k", "head_dim": 32, "mlp_width": 2704}),
    # Seconds on a CPU; 8 heads so that every count up to 8 is possible.
    "tiny": ModelConfig(
        name="tiny", num_heads=8, head_dim=16, num_blocks=2, mlp_width=352, text_dim=64,
        video_channels=4, audio_channels=4, max_text_tokens=64,
        width=256, height=128, frames=9, steps=4, text_tokens=16,
    ),
}


def preset(name: str) -> ModelConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown preset {name!r}; choose one of: {', '.join(PRESETS)}") from None
