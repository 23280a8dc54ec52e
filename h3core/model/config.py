"""MiniMax-H3's dimensions, the named presets, and the frame/latent arithmetic of a request.

Facts (../shared/MINIMAX_H3.md §1.1, §2.5; diffusers 0.42.1 `MiniMaxH3Transformer3DModel`'s
config and `modular_pipelines/minimax_h3/modular_pipeline.py`):

- The residual stream is `hidden` wide (5376) while attention is `num_heads x head_dim` wide
  (56 x 128 = 7168): qkv is `[3 * 7168, 5376]`, out `[5376, 7168]`, fc1 `[2 * 14336, 5376]` (SwiGLU,
  `[gate; up]`), fc2 `[5376, 14336]`.
- Video: the VAE compresses 16x in space and 4x in time, causally in 17-frame chunks, so a video
  of `F = 17n + 5` frames has `T = 5n + 2` latent frames of `H/16 x W/16` (24 channels); the patch
  `(1, 2, 2)` makes `T x H/32 x W/32` rows of 96 features. Width and height are multiples of 32.
  A request for another frame count is snapped *up* to the next `17n + 5` (as the reference does).
- Audio: 40 latents per second per channel (32 features each, no patching), two channels packed
  channel-major: `2 * round(F / 24 * 40)` rows.
- Text: one row per prompt token (the reference never truncates); with keyframes, the prompt as
  the text encoder presents it (`<Picture i>: ` and a vision block per keyframe, then the prompt),
  the vision block's rows tagged 0 (`text_tags`).
- Keyframes (FL2VA): one latent frame of `H/32 x W/32` condition rows per keyframe, after the text
  (first, then last).

At 864x480, 141 frames: T = 42, 15 x 27 patches per frame -> 17,010 video rows; round(141 / 24 *
40) = 235 latents per channel -> 470 audio rows; the packed sequence is L + 17,480 rows.

Two variants of the timestep path (§1.5): **full** (sinusoid -> `time_embedder` MLP -> SiLU ->
`adaln_proj` from 2688 features) and **pruned** (`adaln_t_table [1025, 8]`, lerp, rank-8
`adaln_proj`, no SiLU): `time_embed_dim` is 2688 or 8 and `pruned` says which.

Pure pydantic (no torch): `h3 plan` and the partition checks use it before anything heavy loads.
"""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict, Field, model_validator

from h3core.errors import ConfigError
from h3core.media import AUDIO_STEREO, FPS, SPATIAL_STRIDE, audio_latents, latent_frames, snap_frames
from h3core.model.sequence import Segment, SegmentKind, pack_segments, tag_runs
from h3core.nvfp4 import layout

class ModelConfig(BaseModel):
    """Dimensions of an H3 transformer and the defaults of a run that suit them."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(description="Preset name, or 'checkpoint' when read from a file.")
    hidden: int = Field(gt=0, description="Residual stream width (H3: 5376); a multiple of 16.")
    num_heads: int = Field(gt=0, description="Attention heads (H3: 56).")
    head_dim: int = Field(gt=0, description="Width of one head (H3: 128); a multiple of 16.")
    num_blocks: int = Field(gt=0, description="Transformer blocks (H3: 50).")
    refiner_blocks: int = Field(2, ge=0, description="Token-refiner blocks over the text rows (H3: 2).")
    ffn_dim: int = Field(gt=0, description="SwiGLU inner width F (H3: 14336): fc1 is [2F, hidden], fc2 [hidden, F].")
    text_dim: int = Field(gt=0, description="Width of the text encoder's states (H3: 5120).")
    video_channels: int = Field(24, gt=0, description="Channels of the video latent.")
    audio_channels: int = Field(32, gt=0, description="Channels of the audio latent (one row's features).")
    patch: tuple[int, int, int] = Field((1, 2, 2), description="Video patch (t, h, w).")
    freq_dim: int = Field(256, gt=0, description="Sinusoidal timestep features (full variant).")
    time_hidden: int = Field(gt=0, description="Inner width of the timestep MLP (H3: 5376; full variant).")
    time_embed_dim: int = Field(gt=0, description="Input width of every AdaLN projection: 2688 (full) or the curve rank 8 (pruned).")
    pruned: bool = Field(description="AdaLN-pruned ('curve') variant: `adaln_t_table` instead of the timestep MLP.")
    table_rows: int = Field(1025, ge=2, description="Rows of `adaln_t_table` (pruned variant): t in [0, 1] on a grid of rows - 1 steps.")
    rope_freq_dim: int = Field(16, gt=0, description="RoPE frequencies per (t, h, w) axis: 2 * 3 * this many head channels rotate.")
    rope_theta: float = Field(10000.0, gt=0, description="RoPE base.")
    norm_eps: float = Field(1e-5, gt=0, description="Epsilon of every RMSNorm (blocks, q/k, refiner, final).")
    # Defaults of a run with this preset.
    width: int = Field(gt=0, description="Default video width in pixels.")
    height: int = Field(gt=0, description="Default video height in pixels.")
    frames: int = Field(gt=0, description="Default number of video frames (17n + 5).")
    steps: int = Field(ge=2, description="Default sigma points of the schedule, terminal 0 included (steps - 1 forwards).")
    video_shift: float = Field(12.0, gt=0, description="Flow shift of the video schedule.")
    audio_shift: float = Field(3.0, gt=0, description="Flow shift of the audio schedule.")
    text_tokens: int = Field(gt=0, description="Prompt length assumed when planning without a prompt.")
    max_text_tokens: int = Field(8192, gt=0, description="Longest prompt h3 accepts (refused beyond, never truncated).")
    canvas_short_edge: int | None = Field(None, gt=0, description="With keyframes and no --width/--height: the canvas's short edge (None: the preset's own, min(width, height)).")
    canvas_max_area: int | None = Field(None, gt=0, description="With keyframes and no --width/--height: the canvas's largest area in pixels (None: the preset's own, width x height).")

    @model_validator(mode="after")
    def _check(self) -> "ModelConfig":
        for what, width in (("hidden", self.hidden), ("head_dim", self.head_dim), ("ffn_dim", self.ffn_dim)):
            if not layout.is_block_aligned(width):
                raise ValueError(f"{what} {width} must be a multiple of {layout.BLOCK_ELEMENTS} (NVFP4 blocks)")
        if self.rotary_dim > self.head_dim:
            raise ValueError(f"rope_freq_dim {self.rope_freq_dim} rotates {self.rotary_dim} channels, more than head_dim {self.head_dim}")
        if self.patch[0] != 1:
            raise ValueError("only a temporal patch of 1 is supported (H3's is (1, 2, 2))")
        return self

    @property
    def attention_width(self) -> int:
        """Width of q, k, v and of the attention output: heads x head_dim (H3: 7168, not `hidden`)."""
        return self.num_heads * self.head_dim

    @property
    def rotary_dim(self) -> int:
        """Head channels RoPE rotates (the rest pass through): 2 * 3 axes * rope_freq_dim (H3: 96 of 128)."""
        return 2 * 3 * self.rope_freq_dim

    @property
    def video_patch_dim(self) -> int:
        """Features of one video row: channels x patch volume (H3: 96)."""
        pt, ph, pw = self.patch
        return self.video_channels * pt * ph * pw

    @property
    def pixel_multiple(self) -> int:
        """Width and height must be multiples of this: the VAE's stride x the spatial patch (32)."""
        return SPATIAL_STRIDE * self.patch[1]

    # --- frame and latent arithmetic -----------------------------------------------------------

    @property
    def canvas_rule(self) -> tuple[int, int]:
        """(short edge, largest area) of a canvas that follows a keyframe's aspect: H3's 768 and
        768 x 1344 for the `h3` presets (diffusers' `canvas_short_edge` / `canvas_max_pixels`), the
        preset's own size scale for the small ones (its short edge and its area)."""
        return (self.canvas_short_edge or min(self.width, self.height), self.canvas_max_area or self.width * self.height)

    def video_shape(self, width: int, height: int, frames: int, keyframes: tuple[str, ...] = ()) -> "VideoShape":
        """The latent geometry of a request; raises on sizes the VAE cannot take (frames snapped up)."""
        step = self.pixel_multiple
        if width <= 0 or height <= 0 or width % step or height % step:
            raise ConfigError(
                f"{width}x{height} is not a multiple of {step} pixels on both axes (the VAE's {SPATIAL_STRIDE}x and "
                f"the {self.patch[1]}x{self.patch[2]} patch); try {max(step, round(width / step) * step)}x{max(step, round(height / step) * step)}"
            )
        ratio = width / height
        if not 0.25 <= ratio <= 4.0:
            raise ConfigError(f"{width}x{height} has an aspect ratio of {ratio:.3g}; H3 takes 1:4 to 4:1")
        return VideoShape.of(width, height, frames, self, keyframes)

    def segments(self, width: int, height: int, frames: int, text_tokens: int, *, keyframes: int = 0,
                 text_tags: list[int] | None = None) -> list[Segment]:
        """The packed `text | condition | audio | video` rows of one request (frames snapped up first):
        `keyframes` latent frames of condition rows (0 for t2va); `text_tags`: each text row's tag
        (None: all text, 1), one text segment per run of equal tags (a keyframe's vision block is 0)."""
        if not 0 <= text_tokens <= self.max_text_tokens:
            raise ConfigError(
                f"the prompt has {text_tokens} tokens; h3 takes at most {self.max_text_tokens} "
                "(the reference never truncates, so neither does h3): shorten the prompt"
            )
        if text_tags is not None and len(text_tags) != text_tokens:
            raise ValueError(f"{len(text_tags)} text tags for {text_tokens} text rows")
        shape = self.video_shape(width, height, frames)
        segments = pack_segments([(SegmentKind.TEXT, text_tokens), (SegmentKind.CONDITION, keyframes * shape.rows_per_frame),
                                  (SegmentKind.AUDIO, shape.audio_rows), (SegmentKind.VIDEO, shape.video_rows)])
        return _tagged_text(segments, text_tags) if text_tags else segments

    def num_tokens(self, width: int, height: int, frames: int, text_tokens: int, keyframes: int = 0) -> int:
        """Rows of the packed sequence of one request."""
        return self.segments(width, height, frames, text_tokens, keyframes=keyframes)[-1].stop


def _tagged_text(segments: list[Segment], tags: list[int]) -> list[Segment]:
    """`segments` with their text segment split into one per run of equal `tags`, each with its tag."""
    text, rest = segments[0], segments[1:]
    assert text.kind is SegmentKind.TEXT and len(text) == len(tags)
    split, start = [], 0
    for length, tag in tag_runs(tags):
        split.append(Segment(SegmentKind.TEXT, start, start + length, tag=tag))
        start += length
    return split + rest


class VideoShape(BaseModel):
    """The latent geometry of one request (what the packed sequence and the VAEs agree on)."""

    model_config = ConfigDict(frozen=True)
    width: int
    height: int
    frames_requested: int = Field(description="The frame count asked for.")
    frames: int = Field(description="The frame count generated: the request snapped up to 17n + 5.")
    latent_frames: int = Field(description="T = 5n + 2.")
    latent_height: int = Field(description="H / 16.")
    latent_width: int = Field(description="W / 16.")
    audio_latents: int = Field(description="T_a per channel: round(frames / 24 * 40).")
    video_channels: int
    audio_channels: int
    patch: tuple[int, int, int]
    keyframes: tuple[str, ...] = Field((), description="FL2VA: the end of the video each keyframe's condition frame is anchored to ('first', 'last'), in packed order.")

    @classmethod
    def of(cls, width: int, height: int, frames: int, config: ModelConfig, keyframes: tuple[str, ...] = ()) -> "VideoShape":
        snapped = snap_frames(frames)
        return cls(
            width=width, height=height, frames_requested=frames, frames=snapped, latent_frames=latent_frames(snapped),
            latent_height=height // SPATIAL_STRIDE, latent_width=width // SPATIAL_STRIDE, audio_latents=audio_latents(snapped),
            video_channels=config.video_channels, audio_channels=config.audio_channels, patch=config.patch, keyframes=tuple(keyframes),
        )

    @property
    def grid(self) -> tuple[int, int, int]:
        """Video rows as `(t, h, w)` patches: `T x H/32 x W/32`."""
        pt, ph, pw = self.patch
        return (self.latent_frames // pt, self.latent_height // ph, self.latent_width // pw)

    @property
    def rows_per_frame(self) -> int:
        return self.grid[1] * self.grid[2]

    @property
    def video_rows(self) -> int:
        t, h, w = self.grid
        return t * h * w

    @property
    def condition_rows(self) -> int:
        """Keyframe condition rows: one latent frame per keyframe."""
        return len(self.keyframes) * self.rows_per_frame

    @property
    def condition_latent(self) -> tuple[int, int, int, int]:
        """`[C, n_keyframes, H/16, W/16]` of the keyframes' latents (`latents.safetensors`' `condition_video`)."""
        return (self.video_channels, len(self.keyframes), self.latent_height, self.latent_width)

    @property
    def audio_rows(self) -> int:
        return AUDIO_STEREO * self.audio_latents

    @property
    def video_latent(self) -> tuple[int, int, int, int]:
        """`[C, T, H/16, W/16]` of the video latent (what `latents.safetensors` holds as `video`)."""
        return (self.video_channels, self.latent_frames, self.latent_height, self.latent_width)

    @property
    def audio_latent(self) -> tuple[int, int, int]:
        """`[2, C, T_a]` of the audio latent (what `latents.safetensors` holds as `audio`)."""
        return (AUDIO_STEREO, self.audio_channels, self.audio_latents)

    @property
    def latent_elements(self) -> int:
        """Elements of the video and the audio latent together, and of the keyframes' condition latent (FL2VA)."""
        return math.prod(self.video_latent) + math.prod(self.audio_latent) + math.prod(self.condition_latent)

    @property
    def seconds(self) -> float:
        return self.frames / FPS


# --- presets ---------------------------------------------------------------------------------------

_H3 = ModelConfig(
    name="h3", hidden=5376, num_heads=56, head_dim=128, num_blocks=50, ffn_dim=14336, text_dim=5120,
    time_hidden=5376, time_embed_dim=8, pruned=True,
    width=864, height=480, frames=141, steps=50, text_tokens=128, canvas_short_edge=768, canvas_max_area=768 * 1344,
)
"""The seed's checkpoint: MiniMax-H3 FL2VA, AdaLN-pruned (rank 8), at the seed's 864x480x141 and
the official 50 sigma points (`--steps 12` for the seed's runs)."""

_NARROW = ModelConfig(
    name="narrow", hidden=640, num_heads=56, head_dim=16, num_blocks=2, ffn_dim=1184, text_dim=64,
    time_hidden=640, time_embed_dim=8, pruned=True, rope_freq_dim=2,
    width=128, height=96, frames=22, steps=5, text_tokens=17,
)

PRESETS: dict[str, ModelConfig] = {
    # The real model, the seed's file.
    "h3": _H3,
    # The real widths, sequence and resolution with 2 of the 50 blocks: per-block time and memory
    # on a GPU without the 12.5 GB checkpoint.
    "h3-2blocks": _H3.model_copy(update={"name": "h3-2blocks", "num_blocks": 2}),
    # H3's 56 heads at head width 16 and a residual width (640) that is not heads x head_dim: ragged
    # heads (56 over 6), ragged NVFP4 blocks (hidden 40 and F 74 blocks over 6) on a CPU. Its default
    # sequence (84 video + 74 audio rows + the prompt) divides by none of 2, 4, 6, 8 for most prompts.
    "narrow": _NARROW,
    # narrow's model on a ~1,100-row sequence (980 video + 74 audio + the prompt): enough compute per
    # step for rank scaling to show on CPU ranks.
    "narrow-1k": _NARROW.model_copy(update={"name": "narrow-1k", "width": 448, "height": 320}),
    # H3's 56 heads at head width 32 (attention 1792, residual 1344) and a 169-block MLP on narrow-1k's
    # sequence: about 2 s per forward on one CPU thread (scripts/bench_distributed.py).
    "wide-1k": _NARROW.model_copy(update={"name": "wide-1k", "hidden": 1344, "time_hidden": 1344, "head_dim": 32,
                                          "rope_freq_dim": 4, "ffn_dim": 2704, "width": 448, "height": 320}),
    # Seconds on a CPU; 8 heads so that every count up to 8 is possible.
    "tiny": ModelConfig(
        name="tiny", hidden=96, num_heads=8, head_dim=16, num_blocks=2, ffn_dim=352, text_dim=64,
        time_hidden=96, time_embed_dim=8, pruned=True, rope_freq_dim=2,
        width=256, height=128, frames=22, steps=5, text_tokens=16,
    ),
}


def preset(name: str) -> ModelConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown preset {name!r}; choose one of: {', '.join(PRESETS)}") from None
