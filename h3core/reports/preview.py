"""PNG previews, so a person can look at what came out, drawn with Pillow (no plotting library to
import: matplotlib took 1.3 s of the default `h3 generate`'s 7.5).

- `decoded_preview_png`: the decoded clip, what `video.mp4` holds: its first, middle and last frame
  over the stereo waveform and a spectrogram, labelled when the weights are synthetic;
- `preview_png`: a look at the *latent* (for a run that does not decode): a few frames, evenly
  spaced in time, each with its first three channels mapped to RGB (each channel scaled by its own
  1st..99th percentile over the whole latent), enlarged with nearest-neighbour pixels.

Every picture is pasted at a whole-number scale (nearest-neighbour up, box-averaged down), so an
enlarged frame's pixels are the frame's own.
"""

from __future__ import annotations

import io
import math
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from PIL import Image, ImageDraw, ImageFont

PANEL = 360
"""Width in pixels of one frame's panel (a frame is scaled by a whole number to about this)."""
MARGIN, TEXT = 10, 14
"""Space around panels; the label font's size."""
PLOT_HEIGHT = 160
WAVE_COLORS = ((31, 119, 180), (255, 127, 14))
"""The left and right channels' lines."""
SPECTRUM = ((0, 0, 4), (80, 18, 123), (182, 54, 121), (251, 136, 97), (252, 253, 191))
"""The spectrogram's colour ramp, quiet to loud (dark to light), interpolated linearly."""
DYNAMIC_RANGE_DB = 80.0
NFFT, HOP = 1024, 256
WARNING, INK = (220, 20, 60), (0, 0, 0)


def latent_frames_rgb(latent: torch.Tensor, frames: int = 4) -> torch.Tensor:
    """[C, T, H, W] -> uint8 [n, H, W, 3] for up to `frames` evenly spaced latent frames."""
    c, t, _, _ = latent.shape
    x = latent.detach().float().cpu()
    rgb = x[:3] if c >= 3 else x[:1].expand(3, *x.shape[1:])  # [3, T, H, W]
    flat = rgb.reshape(3, -1)
    lo = flat.quantile(0.01, dim=1)[:, None, None, None]
    hi = flat.quantile(0.99, dim=1)[:, None, None, None]
    scaled = ((rgb - lo) / (hi - lo).clamp_min(1e-6)).clamp(0, 1)
    return (scaled[:, latent_picks(t, frames)] * 255).round().to(torch.uint8).permute(1, 2, 3, 0)  # [n, H, W, 3]


def latent_picks(t: int, frames: int = 4) -> list[int]:
    """Up to `frames` evenly spaced frame indices of `t`."""
    return torch.linspace(0, t - 1, steps=min(frames, t)).round().long().unique().tolist()


def preview_png(latent: torch.Tensor, title: str, frames: int = 4) -> bytes:
    """A one-row strip of latent frames under `title`, as PNG bytes."""
    images = latent_frames_rgb(latent, frames)
    t = latent.shape[1]
    labels = [f"latent frame {frame}/{t - 1}" for frame in latent_picks(t, frames)]
    return _png(_frame_strip(images, labels, title, INK))


# --- the decoded clip: what `video.mp4` holds --------------------------------------------------------


def frame_picks(frames: int) -> list[int]:
    """The first, middle and last frame (fewer when the clip is that short)."""
    return sorted({0, (frames - 1) // 2, frames - 1})


def decoded_preview_png(video: torch.Tensor, audio: torch.Tensor, title: str, sample_rate: int, fps: int, synthetic: bool) -> bytes:
    """Decoded frames (first, middle, last) over the stereo waveform and its spectrogram, as PNG bytes.

    video: [3, F, H, W] in [0, 1]; audio: [2, samples] in [-1, 1]. `synthetic` labels the figure
    (the embedded weights make noise, not a picture of the prompt)."""
    from PIL import Image

    v = video.detach().float().cpu()
    a = audio.detach().float().cpu()
    frames = v.shape[1]
    picks = frame_picks(frames)
    images = (v[:, picks].permute(1, 2, 3, 0) * 255).round().to(torch.uint8)  # [n, H, W, 3]
    labels = [f"frame {frame + 1}/{frames} ({frame / fps:.2f} s)" for frame in picks]
    label = "  ·  SYNTHETIC weights: noise, not the prompt" if synthetic else ""
    strip = _frame_strip(images, labels, title + label, WARNING if synthetic else INK)
    half = (strip.width - 3 * MARGIN) // 2
    plots = Image.new("RGB", (strip.width, PLOT_HEIGHT + 2 * TEXT + 2 * MARGIN), "white")
    plots.paste(_waveform(a, half, sample_rate), (MARGIN, TEXT + MARGIN))
    plots.paste(_spectrogram(a.mean(dim=0), half, sample_rate), (2 * MARGIN + half, TEXT + MARGIN))
    draw = _draw(plots)
    x = MARGIN
    for text, color in (("waveform (stereo): ", INK), ("left", WAVE_COLORS[0]), (", ", INK), ("right", WAVE_COLORS[1])):
        draw.text((x, 2), text, fill=color, font=_font())
        x += round(draw.textlength(text, font=_font()))
    draw.text((2 * MARGIN + half, 2), f"spectrogram (mid): 0-{sample_rate // 2} Hz up, 0-{a.shape[1] / sample_rate:.2f} s across", fill=INK, font=_font())
    return _png(_stack(strip, plots))


# --- drawing -------------------------------------------------------------------------------------------


def _frame_strip(images: torch.Tensor, labels: list[str], title: str, title_color: tuple[int, int, int]) -> "Image.Image":
    """Frames [n, H, W, 3] uint8 side by side, each under its label, under `title`."""
    from PIL import Image

    tiles = [_scaled(Image.fromarray(image.numpy()), PANEL) for image in images]
    width = sum(tile.width for tile in tiles) + MARGIN * (len(tiles) + 1)
    height = max(tile.height for tile in tiles) + 2 * TEXT + 3 * MARGIN
    strip = Image.new("RGB", (width, height), "white")
    draw = _draw(strip)
    draw.text((MARGIN, 2), title, fill=title_color, font=_font())
    x = MARGIN
    for tile, label in zip(tiles, labels):
        draw.text((x, TEXT + MARGIN), label, fill=INK, font=_font())
        strip.paste(tile, (x, 2 * TEXT + 2 * MARGIN))
        x += tile.width + MARGIN
    return strip


def _scaled(image: "Image.Image", width: int) -> "Image.Image":
    """`image` enlarged by a whole number (nearest neighbour) or reduced by one (box average) to about `width`."""
    if image.width <= width:
        factor = max(1, width // image.width)
        return image.resize((image.width * factor, image.height * factor), resample=0)  # 0: NEAREST
    return image.reduce(math.ceil(image.width / width))


def _waveform(audio: torch.Tensor, width: int, sample_rate: int) -> "Image.Image":
    """Both channels of audio [2, samples] in [-1.05, 1.05], each pixel column its samples' min..max."""
    from PIL import Image

    plot = Image.new("RGB", (width, PLOT_HEIGHT), "white")
    draw = _draw(plot)
    middle = PLOT_HEIGHT // 2
    draw.line([(0, middle), (width, middle)], fill=(200, 200, 200))
    for channel, color in enumerate(WAVE_COLORS):
        low, high = _column_extremes(audio[channel], width)
        for x, (lo, hi) in enumerate(zip(_rows(low).tolist(), _rows(high).tolist())):
            draw.line([(x, hi), (x, lo)], fill=color)
    return plot


def _column_extremes(samples: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The min and max of `samples` in each of `width` equal spans of time (a column may hold one sample)."""
    edges = torch.linspace(0, samples.numel(), width + 1).long()
    starts, stops = edges[:-1], torch.maximum(edges[1:], edges[:-1] + 1).clamp_max(samples.numel())
    starts = starts.clamp_max(samples.numel() - 1)
    pieces = [samples[s:e] for s, e in zip(starts.tolist(), stops.tolist())]
    return torch.stack([p.min() for p in pieces]), torch.stack([p.max() for p in pieces])


def _rows(values: torch.Tensor) -> torch.Tensor:
    """Amplitudes in [-1.05, 1.05] -> pixel rows of the plot (up is positive)."""
    return ((1.05 - values.clamp(-1.05, 1.05)) / 2.1 * (PLOT_HEIGHT - 1)).round().long()


def _spectrogram(mid: torch.Tensor, width: int, sample_rate: int) -> "Image.Image":
    """|STFT|^2 of `mid` (Hann window of NFFT, hop HOP) in dB over the top DYNAMIC_RANGE_DB, low frequencies at the bottom."""
    from PIL import Image

    n_fft = min(NFFT, max(2, mid.numel()))
    power = torch.stft(mid, n_fft, hop_length=min(HOP, n_fft), window=torch.hann_window(n_fft), center=False, return_complex=True).abs().square()
    db = 10 * torch.log10(power.clamp_min(1e-20))  # [freq, time]
    level = ((db - db.max() + DYNAMIC_RANGE_DB) / DYNAMIC_RANGE_DB).clamp(0, 1).flip(0)
    image = Image.fromarray(_colors(level).numpy())
    return image.resize((width, PLOT_HEIGHT), resample=0)


def _colors(level: torch.Tensor) -> torch.Tensor:
    """Levels in [0, 1] -> uint8 RGB along SPECTRUM."""
    ramp = torch.tensor(SPECTRUM, dtype=torch.float32)  # [K, 3]
    at = level * (len(SPECTRUM) - 1)
    low = at.floor().long().clamp_max(len(SPECTRUM) - 2)
    frac = (at - low).unsqueeze(-1)
    return (ramp[low] * (1 - frac) + ramp[low + 1] * frac).round().to(torch.uint8)


def _stack(top: "Image.Image", bottom: "Image.Image") -> "Image.Image":
    from PIL import Image

    out = Image.new("RGB", (max(top.width, bottom.width), top.height + bottom.height), "white")
    out.paste(top, (0, 0))
    out.paste(bottom, (0, top.height))
    return out


def _draw(image: "Image.Image") -> "ImageDraw.ImageDraw":
    from PIL import ImageDraw

    return ImageDraw.Draw(image)


def _font() -> "ImageFont.FreeTypeFont | ImageFont.ImageFont":
    from PIL import ImageFont

    return ImageFont.load_default(size=TEXT)


def _png(image: "Image.Image") -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()
