"""MiniMax-H3's sampler (../shared/MINIMAX_H3.md §3): two flow-match schedules, the Euler update, the noise.

diffusers 0.42.1's `MiniMaxH3Scheduler` is the specification (tests compare sigmas, timesteps and
steps with it), and it holds no model:

- `N` sigma points (terminal 0 included, so N - 1 forwards): `base = linspace(1, 0, N)` in float32,
  `sigma = s * base / (1 + (s - 1) * base)` with s = 12 for video and 3 for audio, consecutive
  duplicates dropped. The model is fed `t = 1 - sigma` (t = 1 means clean).
- The model predicts a data-ward velocity: `x0 = x_t + (1 - t) * v` (sigma recovered from t in
  float32, as the reference does), then `x_next = r * x_t + (1 - r) * x0` with `r = sigma_next / sigma`
  from the grid, in float32. Video and audio step on their own schedules at the same index, from one
  forward per step.

Noise: whose noise a seed means is a recipe (`NoiseRecipe`, ../shared/MINIMAX_H3.md §3.5); both
depend only on the seed and the shapes (every world size starts from the same latents), all draws
on CPU generators in float32:

- `official` (the default; SGLang's `latent_preparation.py` / `condition_noise.py`, the server the
  official scripts call): the video latent `[1, 24, T, H, W]` from a CPU generator seeded with the
  seed, then patchified; the audio rows `[2 * T_a, 32]` from a *separate* generator seeded with the
  same seed; each keyframe's condition noise from yet another fresh generator seeded with the seed,
  drawn as `[1, 24, T + n_keyframes, H, W]` of which its first latent frame is kept (so two
  keyframes get the same noise).
- `diffusers` (diffusers 0.42.1's modular pipeline, `MiniMaxH3PrepareConditionLatentsStep` then
  `MiniMaxH3PrepareLatentsStep`): ONE generator seeded with the seed, drawn in this order: one
  `[1, 24, 1, H, W]` per keyframe (packed order), the video latent `[1, 24, T, H, W]`, the audio rows.

For t2va the two differ only in the audio noise (drawn after the video from the same generator, or
from a fresh one). Condition rows are noised once, `c = t z + (1 - t) e` at t = 0.999 in float32
(`noised_condition`), as both references mix them.
"""

from __future__ import annotations

from enum import Enum
from typing import Sequence

import torch

from h3core.errors import NonFiniteResult
from h3core.model.config import VideoShape
from h3core.model.dit import patchify_video
from h3core.model.sequence import CONDITION_LEVEL, SegmentKind


def shifted_sigmas(points: int, shift: float) -> torch.Tensor:
    """`points` float32 sigmas from 1 down to exactly 0 (fewer when the shift makes neighbours equal)."""
    if points < 2:
        raise ValueError(f"a schedule needs at least 2 sigma points, got {points}")
    base = torch.linspace(1.0, 0.0, points, dtype=torch.float32)
    return torch.unique_consecutive(shift * base / (1 + (shift - 1) * base))


class FlowMatchH3:
    """One modality's schedule: `set_timesteps` once, then `step` with each velocity; holds no model."""

    def __init__(self, shift: float):
        self.shift = shift
        self.sigmas = torch.empty(0)
        self.timesteps = torch.empty(0)

    def set_timesteps(self, points: int, sigmas: Sequence[float] | None = None) -> torch.Tensor:
        """The timesteps `t = 1 - sigma` the model is fed, one per forward (`points - 1` of them).
        `sigmas`: an explicit schedule (an adapter's own, h3core.lora.schedule: `points` of them, 1 -> 0,
        strictly decreasing) instead of the shifted one."""
        if sigmas is None:
            self.sigmas = shifted_sigmas(points, self.shift)
        else:
            if len(sigmas) != points:
                raise ValueError(f"{len(sigmas)} sigmas given for {points} points")
            self.sigmas = torch.tensor(list(sigmas), dtype=torch.float32)
        self.timesteps = 1.0 - self.sigmas[:-1]
        return self.timesteps

    @property
    def num_steps(self) -> int:
        return int(self.timesteps.numel())

    def step(self, velocity: torch.Tensor, index: int, sample: torch.Tensor) -> torch.Tensor:
        """One Euler step from `sigmas[index]` to `sigmas[index + 1]`: a float32 sample."""
        sigma_of_t = (1.0 - self.timesteps[index]).to(sample.device)
        denoised = sample.float() + sigma_of_t * velocity.float()
        ratio = (self.sigmas[index + 1] / self.sigmas[index]).to(sample.device)
        return ratio * sample.float() + (1.0 - ratio) * denoised


def guided_velocity(cond: torch.Tensor, uncond: torch.Tensor | None, scale: float) -> torch.Tensor:
    """Classifier-free guidance `uncond + scale * (cond - uncond)` in float32 (`cond` when off).

    Stock H3 is guidance-distilled (one forward per step, scale 1); this is for fine-tuned checkpoints."""
    if uncond is None or scale == 1.0:
        return cond.float()
    return uncond.float() + scale * (cond.float() - uncond.float())


class NoiseRecipe(str, Enum):
    """Whose noise a seed means (module docstring)."""

    OFFICIAL = "official"
    DIFFUSERS = "diffusers"

    def __str__(self) -> str:
        return self.value


def initial_noise(seed: int, shape: VideoShape, recipe: NoiseRecipe | str = NoiseRecipe.OFFICIAL) -> dict[SegmentKind, torch.Tensor]:
    """The starting noise of `recipe` as packed rows, float32: {video: [T*h*w, 96], audio: [2*T_a, 32]}
    and, with keyframes (`shape.keyframes`), {condition: [n*h*w, 96]}, the noise their rows are mixed with."""
    recipe = NoiseRecipe(recipe)
    video_shape, frame = (1, *shape.video_latent), (1, shape.video_channels, 1, shape.latent_height, shape.latent_width)
    keyframes = len(shape.keyframes)
    if recipe is NoiseRecipe.DIFFUSERS:
        generator = _generator(seed)
        condition = [torch.randn(frame, generator=generator, dtype=torch.float32) for _ in range(keyframes)]
        video = torch.randn(video_shape, generator=generator, dtype=torch.float32)
        audio = torch.randn((shape.audio_rows, shape.audio_channels), generator=generator, dtype=torch.float32)
    else:
        video = torch.randn(video_shape, generator=_generator(seed), dtype=torch.float32)
        audio = torch.randn((shape.audio_rows, shape.audio_channels), generator=_generator(seed), dtype=torch.float32)
        longer = (1, shape.video_channels, shape.latent_frames + keyframes, shape.latent_height, shape.latent_width)
        condition = [torch.randn(longer, generator=_generator(seed), dtype=torch.float32)[:, :, :1] for _ in range(keyframes)]
    noise = {SegmentKind.VIDEO: patchify_video(video[0], shape.patch), SegmentKind.AUDIO: audio}
    if keyframes:
        noise[SegmentKind.CONDITION] = torch.cat([patchify_video(c[0], shape.patch) for c in condition])
    return noise


def _generator(seed: int) -> torch.Generator:
    return torch.Generator(device="cpu").manual_seed(seed)


def noised_condition(clean: torch.Tensor, noise: torch.Tensor, level: float = CONDITION_LEVEL) -> torch.Tensor:
    """Keyframe condition rows noised once to timestep `level`: `level * clean + (1 - level) * noise`,
    float32, the level a float32 scalar (diffusers' `scale_noise`, SGLang's condition mix)."""
    t = torch.tensor(level, dtype=torch.float32, device=clean.device)
    return t * clean.float() + (1.0 - t) * noise.to(clean.device, torch.float32)


def check_finite(latent: dict[str, torch.Tensor], *, step: int, steps: int) -> None:
    """Stop the run at the first step whose latent (this rank's rows) holds a NaN or an inf.

    One fused reduction per step (a single device sync); a non-finite latent never reaches a
    report as if it were a result.
    """
    parts = [(name, rows) for name, rows in latent.items() if rows.numel()]
    if not parts or bool(torch.stack([torch.isfinite(rows).all() for _, rows in parts]).all()):
        return
    bad = [name for name, rows in parts if not bool(torch.isfinite(rows).all())]
    raise NonFiniteResult(
        f"the {' and '.join(bad)} latent became NaN or infinite at denoising step {step} of {steps}; "
        "the checkpoint's weights (NaN or inf in them?) or the guidance scale make the sampler diverge"
    )
