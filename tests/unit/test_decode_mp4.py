"""video.mp4 as PyAV writes it and reads it back: H.264 yuv420p 24 fps, AAC-LC stereo 32 kHz,
F frames lasting F/24 s within one frame, audio and video within one frame of each other; and
the probe's contract check fails files that break it."""

from __future__ import annotations

import io
from fractions import Fraction

import numpy as np
import pytest
import torch

from h3core.decode.geometry import geometry_for
from h3core.decode.mp4 import encode_mp4, probe_mp4
from h3core.decode.run import Decoded

FRAME = 1 / 24


def _clip(frames: int, height: int = 64, width: int = 96):
    rng = np.random.default_rng(frames)
    pixels = rng.integers(0, 256, (frames, height, width, 3), dtype=np.uint8)
    samples = round(frames * 32000 / 24)
    t = np.arange(samples) / 32000
    audio = np.stack([0.4 * np.sin(2 * np.pi * 440 * t), 0.4 * np.sin(2 * np.pi * 660 * t)]).astype(np.float32)
    return pixels, audio


@pytest.mark.parametrize("frames", [22, 39, 141])
def test_the_mp4_keeps_the_contract(frames):
    pixels, audio = _clip(frames)
    probe = probe_mp4(encode_mp4(pixels, audio))
    assert (probe.video_codec, probe.pixel_format, probe.fps, probe.frames, probe.width, probe.height) == ("h264", "yuv420p", 24.0, frames, 96, 64)
    assert (probe.audio_codec, probe.audio_profile, probe.sample_rate, probe.channels) == ("aac", "LC", 32000, 2)
    assert "mp4" in probe.container
    assert abs(probe.video_duration_s - frames / 24) <= FRAME
    assert abs(probe.audio_duration_s - frames / 24) <= FRAME and probe.av_drift_s <= FRAME
    assert probe.audio_samples_decoded >= audio.shape[1]  # whole AAC frames: the edit list cuts the padding
    assert probe.problems(geometry_for(96, 64, frames)) == []


def test_the_frames_survive_the_codec():
    """A smooth picture comes back close (H.264 is lossy; a broken colour conversion would not)."""
    import av

    y, x = np.mgrid[0:64, 0:96]
    frame = np.stack([x * 255 // 95, y * 255 // 63, np.full_like(x, 128)], axis=-1).astype(np.uint8)
    pixels = np.repeat(frame[None], 22, axis=0)
    data = encode_mp4(pixels, np.zeros((2, 29333), np.float32))
    with av.open(io.BytesIO(data)) as container:
        first = next(container.decode(video=0)).to_ndarray(format="rgb24")
    assert np.abs(first.astype(int) - frame.astype(int)).mean() < 4


def _foreign_mp4(fps: int, layout: str, rate: int) -> bytes:
    """An mp4 made directly with PyAV, off the contract in one way."""
    import av

    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format="mp4") as container:
        video = container.add_stream("libx264", rate=fps)
        video.width, video.height, video.pix_fmt = 96, 64, "yuv420p"
        sound = container.add_stream("aac", rate=rate, layout=layout)
        for i in range(22):
            frame = av.VideoFrame.from_ndarray(np.zeros((64, 96, 3), np.uint8), format="rgb24")
            frame.pts, frame.time_base = i, Fraction(1, fps)
            container.mux(video.encode(frame))
        channels = 1 if layout == "mono" else 2
        chunk = av.AudioFrame.from_ndarray(np.zeros((channels, rate), np.float32), format="fltp", layout=layout)
        chunk.sample_rate, chunk.pts = rate, 0
        container.mux(sound.encode(chunk))
        container.mux(video.encode(None))
        container.mux(sound.encode(None))
    return buffer.getvalue()


@pytest.mark.parametrize(
    "fps, layout, rate, needle",
    [(25, "stereo", 32000, "25 fps (want 24)"), (24, "mono", 32000, "1 audio channels (want 2)"), (24, "stereo", 44100, "44100 Hz (want 32000)")],
)
def test_the_probe_fails_a_file_off_the_contract(fps, layout, rate, needle):
    problems = probe_mp4(_foreign_mp4(fps, layout, rate)).problems(geometry_for(96, 64, 22))
    assert any(needle in p for p in problems), problems


def test_one_second_of_audio_on_a_short_video_is_drift():
    problems = probe_mp4(_foreign_mp4(24, "stereo", 32000)).problems(geometry_for(96, 64, 22))
    assert any(p.startswith("audio and video differ by") for p in problems), problems


def test_frames_and_waveform_handed_to_the_encoder():
    geometry = geometry_for(32, 32, 22)
    video = torch.tensor([0.0, 0.5, 1 / 255 * 2.5, 1.0]).repeat(3 * 22 * 32 * 8).view(3, 22, 32, 32)
    decoded = Decoded(geometry=geometry, video=video, audio=torch.ones(2, geometry.decoded_samples), seconds={})
    frames = decoded.frames_uint8()
    assert frames.shape == (22, 32, 32, 3) and frames.dtype == torch.uint8
    assert frames[0, 0, :4, 0].tolist() == [0, 128, 2, 255]  # round(x * 255), halves to even: 127.5 -> 128, 2.5 -> 2
    assert decoded.muxed_audio().shape == (2, 29_333)
    short = Decoded(geometry=geometry, video=video, audio=torch.ones(2, 29_000), seconds={})
    assert short.muxed_audio().shape == (2, 29_333) and float(short.muxed_audio()[:, 29_000:].abs().max()) == 0.0
