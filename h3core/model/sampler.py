"""Rectified-flow Euler sampler over shifted sigmas, with no model inside.

Convention: `x_sigma = (1 - sigma) * x0 + sigma * noise`, the model predicts the velocity
`v = noise - x0`, so `dx/dsigma = v` and one Euler step from `sigma_i` to `sigma_{i+1}` is
`x += (sigma_{i+1} - sigma_i) * v`. Sigmas run from 1 to 0; with `steps` steps,
`t_i = 1 - i / steps` and the shifted schedule is `sigma_i = shift * t_i / (1 + (shift - 1) * t_i)`
(the SD3/Wan time shift: a larger shift spends more steps at high noise). Updates are float32
whatever dtype the model computes in.

Noise depends only on the seed and the shapes: it is drawn on the CPU from one generator in a
fixed order, never on a device or per rank, so every world size starts from the same latents.
"""

from __future__ import annotations

import torch

from h3core.errors import NonFiniteResult


def shifted_sigmas(steps: int, shift: float) -> torch.Tensor:
    """`steps + 1` float32 sigmas from 1 down to exactly 0."""
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    t = 1.0 - torch.arange(steps + 1, dtype=torch.float64) / steps
    sigmas = shift * t / (1.0 + (shift - 1.0) * t)
    return sigmas.to(torch.float32)


class FlowMatchEuler:
    """`set_timesteps` once, then `step` with each velocity; holds no model and no latents."""

    def __init__(self, shift: float = 5.0):
        self.shift = shift
        self.sigmas = torch.empty(0)

    def set_timesteps(self, steps: int) -> torch.Tensor:
        self.sigmas = shifted_sigmas(steps, self.shift)
        return self.sigmas[:-1]

    @property
    def num_steps(self) -> int:
        return max(0, len(self.sigmas) - 1)

    def step(self, velocity: torch.Tensor, index: int, sample: torch.Tensor) -> torch.Tensor:
        """One Euler step from `sigmas[index]` to `sigmas[index + 1]`; returns a float32 sample."""
        dt = self.sigmas[index + 1] - self.sigmas[index]
        return sample.float() + dt * velocity.float()


def guided_velocity(cond: torch.Tensor, uncond: torch.Tensor | None, scale: float) -> torch.Tensor:
    """Classifier-free guidance `uncond + scale * (cond - uncond)` in float32 (`cond` when off)."""
    if uncond is None or scale == 1.0:
        return cond.float()
    return uncond.float() + scale * (cond.float() - uncond.float())


def initial_noise(seed: int, shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """Standard normal float32 noise per named latent, from one CPU generator, in the given key order."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    return {name: torch.randn(shape, generator=generator, dtype=torch.float32) for name, shape in shapes.items()}


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
