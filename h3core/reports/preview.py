"""A PNG preview of a video latent, so a person can look at what came out.

This is a look at the *latent*, not a decoded video (h3 has no VAE decoder): a few frames,
evenly spaced in time, each with its first three channels mapped to RGB (each channel scaled by
its own 1st..99th percentile over the whole latent), enlarged with nearest-neighbour pixels.
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
