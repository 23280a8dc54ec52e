"""`h3 compare A B`: how far two runs' clips are apart, so a user can judge a step cache setting, an
adapter, or NVFP4 against bf16 on their own weights.

A and B are two `video.mp4` files or two run folders (their `video.mp4`). Read back with PyAV (the
same decoder `h3 generate` probes with), the frames as 8-bit RGB and the audio as float samples:

- PSNR (dB) of the whole video, 10 log10(255^2 / MSE) over every pixel of every frame (the
  worst frame's beside it); None where the clips are identical (an infinite ratio);
- SSIM (Wang et al. 2004) on luma (BT.601 Y from RGB), an 11 x 11 Gaussian window of sigma 1.5,
  C1 = (0.01 x 255)^2, C2 = (0.03 x 255)^2, over the window positions inside the frame, averaged
  per frame and then over frames (the worst frame's beside it); 1 for identical clips;
- the audio's SNR (dB), A taken as the signal: 10 log10(sum a^2 / sum (a - b)^2) over both
  channels; None where identical.

On the synthetic weights both clips are noise: the figures then say how far two noises are apart,
nothing about quality (the line says so when either run's report says `weights: synthetic`).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import BaseModel, Field

from h3core.errors import ConfigError
from h3core.files.paths import path_kind

if TYPE_CHECKING:
    import torch

MAX_CLIP_BYTES = 8 << 30
"""The largest mp4 `h3 compare` decodes (an H3 clip at 1344x768x243 is tens of MB)."""
_WINDOW, _SIGMA = 11, 1.5


class ClipDistance(BaseModel):
    a: str
    b: str
    frames: int
    width: int
    height: int
    identical: bool = Field(description="Every frame and every sample equal.")
    psnr_db: float | None = Field(description="PSNR of the whole video (None: identical).")
    psnr_worst_frame_db: float | None
    ssim: float = Field(description="Mean SSIM on luma over frames (1: identical).")
    ssim_worst_frame: float
    audio_snr_db: float | None = Field(description="SNR of B's audio against A's (None: identical).")
    synthetic: bool = Field(description="Either run's report says its weights were synthetic: the figures compare noise.")


def compare_clips(a: Path, b: Path) -> ClipDistance:
    """The distance between clips `a` and `b` (module docstring); a ConfigError line for anything it cannot compare."""
    import torch

    first, second = _clip_file(a), _clip_file(b)
    (frames_a, audio_a), (frames_b, audio_b) = _read(first), _read(second)
    if frames_a.shape != frames_b.shape:
        raise ConfigError(f"the clips differ in shape: {_shape(frames_a)} ({first}) and {_shape(frames_b)} ({second}); compare two runs of the same size")
    if audio_a.shape[0] != audio_b.shape[0]:
        raise ConfigError(f"the clips' audio has {audio_a.shape[0]} and {audio_b.shape[0]} channels; compare two runs of the same kind")
    return distance(frames_a, audio_a, frames_b, audio_b).model_copy(update={"a": str(first), "b": str(second), "synthetic": _synthetic(first) or _synthetic(second)})


def distance(frames_a: "torch.Tensor", audio_a: "torch.Tensor", frames_b: "torch.Tensor", audio_b: "torch.Tensor") -> ClipDistance:
    """The figures of two clips of one shape: frames uint8 [F, H, W, 3], audio [C, N] (the common length compared)."""
    import torch

    n = min(audio_a.shape[1], audio_b.shape[1])
    audio_a, audio_b = audio_a[:, :n].double(), audio_b[:, :n].double()
    frame_mse = ((frames_a.double() - frames_b.double()) ** 2).mean(dim=(1, 2, 3))
    ssims = torch.stack([_ssim(_luma(x), _luma(y)) for x, y in zip(frames_a, frames_b)])
    noise = float(((audio_a - audio_b) ** 2).sum())
    return ClipDistance(
        a="", b="", frames=frames_a.shape[0], width=frames_a.shape[2], height=frames_a.shape[1],
        identical=bool(torch.equal(frames_a, frames_b) and noise == 0.0),
        psnr_db=_psnr(float(frame_mse.mean())), psnr_worst_frame_db=_psnr(float(frame_mse.max())),
        ssim=float(ssims.mean()), ssim_worst_frame=float(ssims.min()),
        audio_snr_db=None if noise == 0.0 else 10 * math.log10(max(float((audio_a**2).sum()), 1e-300) / noise), synthetic=False,
    )


def _clip_file(path: Path) -> Path:
    """The mp4 of `path`: the file itself, or a run folder's video.mp4; checked before it is read."""
    target = path / "video.mp4" if path.is_dir() else path
    if not target.is_file():
        kind = "a folder without video.mp4" if path.is_dir() else ("no such file" if not path.exists() else path_kind(path))
        raise ConfigError(f"{path}: {kind}; give a video.mp4 or the folder of an h3 run")
    if target.stat().st_size > MAX_CLIP_BYTES:
        raise ConfigError(f"{target} is {target.stat().st_size:,} bytes, over the {MAX_CLIP_BYTES:,} h3 compare reads")
    return target


def _read(path: Path) -> "tuple[torch.Tensor, torch.Tensor]":
    """(frames uint8 [F, H, W, 3], audio float32 [C, N]) of the mp4 at `path`."""
    import av
    import numpy as np
    import torch

    try:
        with av.open(str(path), mode="r") as container:
            if not container.streams.video:
                raise ConfigError(f"{path} has no video stream; give the video.mp4 of an h3 run")
            frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
            container.seek(0)
            audio = [f.to_ndarray() for f in container.decode(audio=0)] if container.streams.audio else []
    except av.error.FFmpegError as err:
        raise ConfigError(f"{path} is not a readable mp4 ({type(err).__name__}); give the video.mp4 of an h3 run") from None
    if not frames:
        raise ConfigError(f"{path} holds no video frames")
    sound = np.concatenate(audio, axis=1) if audio else np.zeros((1, 0), dtype=np.float32)
    return torch.from_numpy(np.stack(frames)), torch.from_numpy(np.ascontiguousarray(sound, dtype=np.float32))


def _psnr(mse: float) -> float | None:
    return None if mse == 0.0 else 10 * math.log10(255.0**2 / mse)


def _luma(rgb: "torch.Tensor") -> "torch.Tensor":
    """BT.601 luma of an 8-bit RGB frame [H, W, 3] as float64 [H, W] in 0..255."""
    x = rgb.double()
    return 0.299 * x[..., 0] + 0.587 * x[..., 1] + 0.114 * x[..., 2]


def _ssim(x: "torch.Tensor", y: "torch.Tensor") -> "torch.Tensor":
    """Mean SSIM of two luma frames (module docstring); frames smaller than the window use the whole frame as one window."""
    import torch
    import torch.nn.functional as F

    size = min(_WINDOW, x.shape[0], x.shape[1])
    g = torch.exp(-((torch.arange(size, dtype=torch.float64) - (size - 1) / 2) ** 2) / (2 * _SIGMA**2))
    g = g / g.sum()
    window = (g[:, None] * g[None, :])[None, None]
    blur = lambda t: F.conv2d(t[None, None], window)[0, 0]  # noqa: E731
    mx, my = blur(x), blur(y)
    vx, vy, cxy = blur(x * x) - mx**2, blur(y * y) - my**2, blur(x * y) - mx * my
    c1, c2 = (0.01 * 255) ** 2, (0.03 * 255) ** 2
    ssim = ((2 * mx * my + c1) * (2 * cxy + c2)) / ((mx**2 + my**2 + c1) * (vx + vy + c2))
    return ssim.mean()


def _synthetic(clip: Path) -> bool:
    """Whether the run that wrote `clip` says its weights were synthetic (its report.json beside it)."""
    from h3core.files.text import read_json

    report = clip.parent / "report.json"
    if not report.is_file():
        return False
    try:
        data = read_json(report, "a run's report", 64 << 20, "it is not an h3 report")
    except ConfigError:  # an unreadable report says nothing about the weights; the clips still compare
        return False
    return isinstance(data, dict) and data.get("weights") == "synthetic"


def _shape(frames: "torch.Tensor") -> str:
    return f"{frames.shape[0]} frames of {frames.shape[2]}x{frames.shape[1]}"
