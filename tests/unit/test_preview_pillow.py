"""preview.png drawn with Pillow (issue 35.6): the frames are the decoded (or latent) frames' own
pixels, the waveform and the spectrogram show the audio, the synthetic label is there, and writing
it imports no plotting library."""

from __future__ import annotations

import io
import math

import torch
from commands import fresh_python
from PIL import Image

from h3core.reports.preview import MARGIN, PANEL, PLOT_HEIGHT, TEXT, decoded_preview_png, frame_picks, latent_frames_rgb, preview_png

RATE, FPS = 32000, 24


def _pixels(png: bytes) -> torch.Tensor:
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    return torch.from_numpy(__import__("numpy").asarray(Image.open(io.BytesIO(png)).convert("RGB")).copy())  # [H, W, 3]


def _tile(picture: torch.Tensor, index: int, height: int, width: int) -> torch.Tensor:
    """The `index`-th frame panel of a strip whose frames are `height` x `width` before scaling."""
    scale = PANEL // width
    x = MARGIN + index * (width * scale + MARGIN)
    y = 2 * TEXT + 2 * MARGIN
    return picture[y : y + height * scale, x : x + width * scale]


def _clip(frames: int = 9, height: int = 16, width: int = 40, seconds: float = 0.5, tone_hz: float = 4000.0):
    video = torch.rand(3, frames, height, width, generator=torch.Generator().manual_seed(0))
    t = torch.arange(int(seconds * RATE)) / RATE
    audio = torch.stack([0.9 * torch.sin(2 * math.pi * tone_hz * t), torch.zeros_like(t)])
    return video, audio


def test_decoded_frames_are_the_clips_own_pixels_enlarged_exactly():
    video, audio = _clip()
    picture = _pixels(decoded_preview_png(video, audio, "h3 test", RATE, FPS, synthetic=False))
    scale = PANEL // video.shape[3]
    for index, frame in enumerate(frame_picks(video.shape[1])):
        want = (video[:, frame].permute(1, 2, 0) * 255).round().to(torch.uint8)
        tile = _tile(picture, index, video.shape[2], video.shape[3])
        assert torch.equal(tile[::scale, ::scale], want)
        assert torch.equal(tile, want.repeat_interleave(scale, 0).repeat_interleave(scale, 1))


def test_the_synthetic_label_is_red_and_only_when_synthetic():
    video, audio = _clip()
    reddish = lambda p: ((p[..., 0] > 180) & (p[..., 1] < 90) & (p[..., 2] < 110)).sum().item()  # noqa: E731
    title = slice(0, TEXT + 4)
    assert reddish(_pixels(decoded_preview_png(video, audio, "t", RATE, FPS, synthetic=True))[title]) > 50
    assert reddish(_pixels(decoded_preview_png(video, audio, "t", RATE, FPS, synthetic=False))[title]) == 0


def test_waveform_reaches_the_tone_amplitude_and_the_spectrogram_peaks_at_its_frequency():
    video, audio = _clip(tone_hz=4000.0)
    picture = _pixels(decoded_preview_png(video, audio, "t", RATE, FPS, synthetic=False))
    strip_height = picture.shape[0] - (PLOT_HEIGHT + 2 * TEXT + 2 * MARGIN)
    top = strip_height + TEXT + MARGIN
    half = (picture.shape[1] - 3 * MARGIN) // 2
    wave = picture[top : top + PLOT_HEIGHT, MARGIN : MARGIN + half].int()
    blue = (wave[..., 2] > 150) & (wave[..., 0] < 80)  # the left channel (the tone); the right is silent
    rows = blue.any(dim=1).nonzero().flatten()
    peak_row = round((1.05 - 0.9) / 2.1 * (PLOT_HEIGHT - 1))
    assert abs(rows.min().item() - peak_row) <= 1 and abs(rows.max().item() - (PLOT_HEIGHT - 1 - peak_row)) <= 1
    spec = picture[top : top + PLOT_HEIGHT, 2 * MARGIN + half : 2 * MARGIN + 2 * half].float().sum(dim=(1, 2))
    brightest = int(spec.argmax())
    expected = round((1 - 4000 / (RATE / 2)) * (PLOT_HEIGHT - 1))
    assert abs(brightest - expected) <= 3


def test_latent_preview_is_the_latent_frames_enlarged_exactly():
    latent = torch.randn(24, 7, 8, 16, generator=torch.Generator().manual_seed(1))
    picture = _pixels(preview_png(latent, "h3 latent"))
    images = latent_frames_rgb(latent)
    assert images.shape[0] == 4
    scale = PANEL // 16
    for index, image in enumerate(images):
        tile = _tile(picture, index, 8, 16)
        assert torch.equal(tile, image.repeat_interleave(scale, 0).repeat_interleave(scale, 1))


def test_large_frames_are_reduced_to_about_a_panel():
    video, audio = _clip(frames=2, height=90, width=1280, seconds=0.05)
    picture = _pixels(decoded_preview_png(video, audio, "t", RATE, FPS, synthetic=False))
    assert picture.shape[1] <= 2 * (PANEL + MARGIN) + MARGIN  # two frames (first = middle), each reduced 4x to 320 px


def test_writing_a_preview_imports_no_plotting_library():
    code = (
        "import sys, torch; from h3core.reports.preview import decoded_preview_png as d;"
        "d(torch.rand(3, 3, 8, 8), torch.zeros(2, 4000), 't', 32000, 24, True);"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'matplotlib'))"
    )
    assert fresh_python(code).strip() == "[]"
