"""PNG previews, so a person can look at what came out.

- `decoded_preview_png`: the decoded clip, what `video.mp4` holds: its first, middle and last frame
  over the stereo waveform and a spectrogram, labelled when the weights are synthetic;
- `preview_png`: a look at the *latent* (for a run that does not decode): a few frames, evenly
  spaced in time, each with its first three channels mapped to RGB (each channel scaled by its own
  1st..99th percentile over the whole latent), enlarged with nearest-neighbour pixels.
"""

from __future__ import annotations

import io

import torch


def latent_frames_rgb(latent: torch.Tensor, frames: int = 4) -> torch.Tensor:
    """[C, T, H, W] -> uint8 [n, H, W, 3] for up to `frames` evenly spaced latent frames."""
    c, t, _, _ = latent.shape
    x = latent.detach().float().cpu()
    rgb = x[:3] if c >= 3 else x[:1].expand(3, *x.shape[1:])  # [3, T, H, W]
    flat = rgb.reshape(3, -1)
    lo = flat.quantile(0.01, dim=1)[:, None, None, None]
    hi = flat.quantile(0.99, dim=1)[:, None, None, None]
    scaled = ((rgb - lo) / (hi - lo).clamp_min(1e-6)).clamp(0, 1)
    picks = torch.linspace(0, t - 1, steps=min(frames, t)).round().long().unique()
    return (scaled[:, picks] * 255).round().to(torch.uint8).permute(1, 2, 3, 0)  # [n, H, W, 3]


def preview_png(latent: torch.Tensor, title: str, frames: int = 4) -> bytes:
    """A one-row strip of latent frames, as PNG bytes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    images = latent_frames_rgb(latent, frames)
    n = images.shape[0]
    fig, axes = plt.subplots(1, n, figsize=(3.2 * n, 3.2 * images.shape[1] / images.shape[2] + 0.6), squeeze=False)
    t = latent.shape[1]
    picks = torch.linspace(0, t - 1, steps=min(frames, t)).round().long().unique().tolist()
    for ax, image, frame in zip(axes[0], images, picks):
        ax.imshow(image.numpy(), interpolation="nearest")
        ax.set_title(f"latent frame {frame}/{t - 1}", fontsize=9)
        ax.axis("off")
    fig.suptitle(title, fontsize=10)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100, bbox_inches="tight")
    plt.close(fig)
    return buffer.getvalue()


# --- the decoded clip: what `video.mp4` holds --------------------------------------------------------


def frame_picks(frames: int) -> list[int]:
    """The first, middle and last frame (fewer when the clip is that short)."""
    return sorted({0, (frames - 1) // 2, frames - 1})


def decoded_preview_png(video: torch.Tensor, audio: torch.Tensor, title: str, sample_rate: int, fps: int, synthetic: bool) -> bytes:
    """Decoded frames (first, middle, last) over the stereo waveform and its spectrogram, as PNG bytes.

    video: [3, F, H, W] in [0, 1]; audio: [2, samples] in [-1, 1]. `synthetic` labels the figure
    (the embedded weights make noise, not a picture of the prompt)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    v = video.detach().float().cpu()
    a = audio.detach().float().cpu().numpy()
    frames, height, width = v.shape[1], v.shape[2], v.shape[3]
    picks = frame_picks(frames)
    fig = plt.figure(figsize=(3.6 * len(picks), 3.6 * height / width + 3.2))
    grid = fig.add_gridspec(2, len(picks) * 2, height_ratios=[height / width * len(picks), 1.4])
    for i, frame in enumerate(picks):
        ax = fig.add_subplot(grid[0, 2 * i : 2 * i + 2])
        ax.imshow((v[:, frame].permute(1, 2, 0) * 255).round().to(torch.uint8).numpy())
        ax.set_title(f"frame {frame + 1}/{frames} ({frame / fps:.2f} s)", fontsize=9)
        ax.axis("off")
    half = len(picks)
    wave = fig.add_subplot(grid[1, :half])
    seconds = [i / sample_rate for i in range(a.shape[1])]
    for channel, name in enumerate(("left", "right")):
        wave.plot(seconds, a[channel], linewidth=0.4, alpha=0.8, label=name)
    wave.set_xlim(0, a.shape[1] / sample_rate)
    wave.set_ylim(-1.05, 1.05)
    wave.set_xlabel("s", fontsize=8)
    wave.set_title("waveform (stereo)", fontsize=9)
    wave.legend(fontsize=7, loc="upper right")
    spec = fig.add_subplot(grid[1, half:])
    spec.specgram(a.mean(axis=0), NFFT=1024, Fs=sample_rate, noverlap=768, cmap="magma")
    spec.set_xlabel("s", fontsize=8)
    spec.set_ylabel("Hz", fontsize=8)
    spec.set_title("spectrogram (mid)", fontsize=9)
    label = "  ·  SYNTHETIC weights: noise, not the prompt" if synthetic else ""
    fig.suptitle(title + label, fontsize=10, color="crimson" if synthetic else "black")
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    plt.close(fig)
    return buffer.getvalue()
