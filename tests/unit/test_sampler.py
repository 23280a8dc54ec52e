
import pytest
import torch

from h3core.model.sampler import FlowMatchEuler, guided_velocity, initial_noise, shifted_sigmas


def test_shifted_sigmas_match_a_hand_computed_schedule():
    # steps=4, shift=3: t = 1, .75, .5, .25, 0 ; sigma = 3t / (1 + 2t)
    expected = [1.0, 2.25 / 2.5, 1.5 / 2.0, 0.75 / 1.5, 0.0]
    assert shifted_sigmas(4, 3.0).tolist() == pytest.approx(expected, abs=1e-7)
    assert shifted_sigmas(12, 1.0).tolist() == pytest.approx([1 - i / 12 for i in range(13)], abs=1e-7)
    s = shifted_sigmas(12, 5.0)
    assert s.dtype == torch.float32 and s[0] == 1.0 and s[-1] == 0.0 and bool((s[1:] < s[:-1]).all())


def test_euler_step_integrates_a_constant_velocity_exactly_to_data():
    sampler = FlowMatchEuler(shift=5.0)
    sigmas = sampler.set_timesteps(7)
    data = torch.randn(3, 5)
    noise = torch.randn(3, 5)
    x = noise.clone()
    for i in range(len(sigmas)):
        x = sampler.step(noise - data, i, x)  # the true velocity of a straight path
    assert torch.allclose(x, data, atol=1e-5)
    assert sampler.step(torch.ones(2, dtype=torch.bfloat16), 0, torch.zeros(2, dtype=torch.bfloat16)).dtype == torch.float32


def test_noise_depends_only_on_seed_and_shapes():
    a = initial_noise(7, {"video": (2, 3, 4), "audio": (5,)})
    b = initial_noise(7, {"video": (2, 3, 4), "audio": (5,)})
    c = initial_noise(8, {"video": (2, 3, 4), "audio": (5,)})
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["video"], c["video"])
    assert a["video"].dtype == torch.float32


def test_guidance():
    cond, uncond = torch.tensor([2.0]), torch.tensor([1.0])
    assert guided_velocity(cond, uncond, 1.0).item() == 2.0
    assert guided_velocity(cond, uncond, 3.0).item() == 4.0
    assert guided_velocity(cond, None, 3.0).item() == 2.0


def test_a_non_finite_latent_stops_the_run_naming_the_step():
    from h3core.errors import NonFiniteResult
    from h3core.model.sampler import check_finite

    check_finite({"video": torch.randn(5, 4), "audio": torch.zeros(0, 4)}, step=1, steps=4)  # finite, and empty rows
    bad = torch.randn(5, 4)
    bad[2, 1] = float("inf")
    with pytest.raises(NonFiniteResult, match=r"the audio latent became NaN or infinite at denoising step 3 of 4"):
        check_finite({"video": torch.randn(5, 4), "audio": bad}, step=3, steps=4)
    with pytest.raises(NonFiniteResult, match="the video and audio latent"):
        check_finite({"video": torch.full((2, 2), float("nan")), "audio": bad}, step=1, steps=1)
