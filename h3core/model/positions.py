"""The `(t, h, w)` RoPE positions of a packed t2va / fl2va sequence (../shared/MINIMAX_H3.md §2.2), float64.

- text row `i`: `(i, 0, 0)`; the text length `L` shifts the whole media clock;
- a keyframe's condition frame: the video's spatial grid at time `L` ("first") or at the time of the
  last video frame, `L + 5/3 (F - 1)` ("last"), that sum taken as the reference takes it (numpy's
  pairwise sum of the latent frames' spans, less one frame's 5/3);
- audio latent `a` of channel 0: `(L + a, 0, w_first)`, of channel 1: `(L + a, 0, w_last)` (the two
  ends of the video's width grid);
- video latent frame `k`, patch `(i, j)`: `(L + tau_k, h_i, w_j)` with `tau` advancing `5/3 x (1, 4,
  4, 4, 4)` per latent frame (the VAE's 17-frames-to-5-latents grouping): one audio latent (25 ms)
  and 5/3 units per video frame (1/24 s) put both clocks at 40 units per second;
- the spatial grid is aspect-normalised: `linspace(left, left + ratio, n, endpoint=False) * 32` with
  `ratio = dim / sqrt(H_lat * W_lat)` and `left = (1 - ratio) / 2`.

Built in float64 exactly as the reference builds it (numpy's linspace for the spatial axes, a
float64 cumulative sum for time); the model casts to float32 before the RoPE multiply.
"""

from __future__ import annotations

import numpy as np
import torch

from h3core.model.config import VideoShape
from h3core.model.sequence import Segment, SegmentKind

FRAME_UNITS = 5.0 / 3.0
"""RoPE time units per video frame at 24 fps (40 units per second)."""

FRAMES_PER_LATENT = (1, 4, 4, 4, 4)
"""Video frames each latent frame of a 5-latent chunk covers (the first latent is one frame)."""

SPATIAL_SCALE = 32


def spatial_grid(latent_dim: int, patch: int, sqrt_area: float) -> torch.Tensor:
    """One spatial axis: `latent_dim // patch` float64 coordinates centred on the unit interval, x 32."""
    ratio = latent_dim / sqrt_area
    left = (1.0 - ratio) / 2.0
    return torch.from_numpy(np.linspace(left, left + ratio, latent_dim // patch, endpoint=False) * SPATIAL_SCALE)


def temporal_grid(latent_frames: int, origin: float) -> torch.Tensor:
    """The RoPE time of each latent frame: `origin` plus the running sum of the spans before it."""
    spans = torch.tensor([FRAME_UNITS * FRAMES_PER_LATENT[k % len(FRAMES_PER_LATENT)] for k in range(latent_frames)], dtype=torch.float64)
    return origin + torch.cat([torch.zeros(1, dtype=torch.float64), spans[:-1].cumsum(0)])


def position_ids(segments: list[Segment], shape: VideoShape) -> torch.Tensor:
    """`[S, 3]` float64 `(t, h, w)` of every row of a `text | condition | audio | video` sequence
    (the condition rows: one frame per anchor of `shape.keyframes`, in that order)."""
    total = segments[-1].stop if segments else 0
    positions = torch.zeros(total, 3, dtype=torch.float64)
    text = sum(len(s) for s in segments if s.kind is SegmentKind.TEXT)
    _, ph, pw = shape.patch
    sqrt_area = float(np.sqrt(shape.latent_height * shape.latent_width))
    heights = spatial_grid(shape.latent_height, ph, sqrt_area)
    widths = spatial_grid(shape.latent_width, pw, sqrt_area)
    for seg in segments:
        rows = positions[seg.start : seg.stop]
        if seg.kind is SegmentKind.TEXT:
            rows[:, 0] = torch.arange(seg.start, seg.stop, dtype=torch.float64)
        elif seg.kind is SegmentKind.AUDIO:
            rows.copy_(audio_positions(shape.audio_latents, float(text), widths))
        elif seg.kind is SegmentKind.CONDITION:
            assert len(seg) == shape.condition_rows, f"{len(seg)} condition rows for the keyframes {shape.keyframes}"
            rows.copy_(condition_positions(shape, heights, widths, float(text)))  # (one segment: every keyframe's rows)
        else:
            rows.copy_(video_positions(shape.grid[0], heights, widths, float(text)))
    return positions


KEYFRAME_ANCHORS = ("first", "last")
"""Where a keyframe's condition frame sits on the video's clock: its first frame or its last."""


def anchor_time(anchor: str, latent_frames: int, origin: float) -> float:
    """The RoPE time of a keyframe anchored at the video's `anchor` end: `origin` (first) or the time of
    its last frame, `origin + 5/3 (F - 1)`, summed as the reference sums it (numpy's pairwise sum of the
    latent frames' spans, then one frame's span taken off)."""
    if anchor == "first":
        return origin
    if anchor != "last":
        raise ValueError(f"a keyframe anchor is one of {', '.join(KEYFRAME_ANCHORS)}, got {anchor!r}")
    spans = np.ones(latent_frames, dtype=np.float64) * FRAME_UNITS
    for offset, frames in enumerate(FRAMES_PER_LATENT):
        spans[offset :: len(FRAMES_PER_LATENT)] *= frames
    return origin + float(spans.sum()) - FRAME_UNITS


def condition_positions(shape: VideoShape, heights: torch.Tensor, widths: torch.Tensor, origin: float) -> torch.Tensor:
    """`[n * h * w, 3]`: one frame of the video's spatial grid per keyframe of `shape.keyframes`, at its anchor's time."""
    h, w = torch.meshgrid(heights, widths, indexing="ij")
    frame = torch.stack([h.reshape(-1), w.reshape(-1)], dim=-1)  # [h * w, 2]
    out = torch.empty(len(shape.keyframes), frame.shape[0], 3, dtype=torch.float64)
    for index, anchor in enumerate(shape.keyframes):
        out[index, :, 0] = anchor_time(anchor, shape.grid[0], origin)
    out[:, :, 1:] = frame[None]
    return out.reshape(-1, 3)


def audio_positions(latents: int, origin: float, widths: torch.Tensor) -> torch.Tensor:
    """`[2 * latents, 3]`: both channels, channel-major, on the two ends of the width grid."""
    out = torch.zeros(2 * latents, 3, dtype=torch.float64)
    out[:, 0] = (origin + torch.arange(latents, dtype=torch.float64)).repeat(2)
    out[:latents, 2] = float(widths[0])
    out[latents:, 2] = float(widths[-1])
    return out


def video_positions(latent_frames: int, heights: torch.Tensor, widths: torch.Tensor, origin: float) -> torch.Tensor:
    """`[T * h * w, 3]`: frames in order, each h-major then w."""
    h, w = torch.meshgrid(heights, widths, indexing="ij")
    frame = torch.stack([h.reshape(-1), w.reshape(-1)], dim=-1)  # [h * w, 2]
    out = torch.empty(latent_frames, frame.shape[0], 3, dtype=torch.float64)
    out[:, :, 0] = temporal_grid(latent_frames, origin)[:, None]
    out[:, :, 1:] = frame[None]
    return out.reshape(-1, 3)
