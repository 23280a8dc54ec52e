"""The sampler against diffusers 0.42.1's `MiniMaxH3Scheduler` and the official server's noise recipe."""

import pytest
import torch

from h3core.model.config import preset
from h3core.model.sampler import FlowMatchH3, NoiseRecipe, guided_velocity, initial_noise, noised_condition, shifted_sigmas
from h3core.model.sequence import SegmentKind


@pytest.mark.parametrize("shift", [12.0, 3.0, 1.0, 5.5])
@pytest.mark.parametrize("points", [2, 5, 12, 50, 200])
def test_schedules_equal_diffusers(points, shift):
    from diffusers import MiniMaxH3Scheduler

    reference = MiniMaxH3Scheduler(shift=shift)
    reference.set_timesteps(points)
    ours = FlowMatchH3(shift)
    timesteps = ours.set_timesteps(points)
    assert torch.equal(ours.sigmas, reference.sigmas) and torch.equal(timesteps, reference.timesteps)
    assert ours.num_steps == points - 1 and timesteps[0] == 0.0


def test_the_official_50_point_schedules():
    """../shared/MINIMAX_H3.md §3.1: video t runs 0, 0.001733 ... 0.8; audio t 0, 0.006897 ... 0.9412."""
    video, audio = FlowMatchH3(12.0).set_timesteps(50), FlowMatchH3(3.0).set_timesteps(50)
    assert video.numel() == audio.numel() == 49
    assert video[1].item() == pytest.approx(0.001733, abs=1e-6) and video[-1].item() == pytest.approx(0.8, abs=1e-6)
    assert audio[1].item() == pytest.approx(0.006897, abs=1e-6) and audio[-1].item() == pytest.approx(0.9412, abs=1e-4)


def test_steps_equal_diffusers():
    from diffusers import MiniMaxH3Scheduler

    reference, ours = MiniMaxH3Scheduler(shift=12.0), FlowMatchH3(12.0)
    reference.set_timesteps(9)
    ours.set_timesteps(9)
    x_ref = x_ours = torch.randn(7, 96)
    for i, t in enumerate(reference.timesteps):
        v = torch.randn(7, 96)
        x_ref = reference.step(v, t, x_ref, return_dict=False)[0]
        x_ours = ours.step(v, i, x_ours)
        assert torch.equal(x_ours, x_ref)


def test_a_data_ward_velocity_lands_on_the_data():
    """v = x0 - noise (the model's convention: t = 1 is clean) takes pure noise to x0 whatever the schedule."""
    sampler = FlowMatchH3(12.0)
    sampler.set_timesteps(7)
    data, noise = torch.randn(3, 5), torch.randn(3, 5)
    x = noise.clone()
    for i in range(sampler.num_steps):
        x = sampler.step(data - noise, i, x)
    assert torch.allclose(x, data, atol=1e-5)
    assert sampler.step(torch.ones(2, dtype=torch.bfloat16), 0, torch.zeros(2, dtype=torch.bfloat16)).dtype == torch.float32


def test_noise_is_the_official_servers_recipe():
    """SGLang's latent preparation: video from a CPU generator seeded with the seed, patchified; audio rows
    from a *separate* generator re-seeded with the same seed (so both start like the official runs)."""
    from diffusers.modular_pipelines.minimax_h3.before_denoise import patchify_video_latents

    shape = preset("tiny").video_shape(256, 128, 22)
    noise = initial_noise(42, shape)
    video = torch.randn(1, 24, 7, 8, 16, generator=torch.Generator().manual_seed(42))
    audio = torch.randn(2 * 37, 32, generator=torch.Generator().manual_seed(42))
    assert torch.equal(noise[SegmentKind.VIDEO], patchify_video_latents(video, (1, 2, 2)))
    assert torch.equal(noise[SegmentKind.AUDIO], audio)
    assert not torch.equal(initial_noise(43, shape)[SegmentKind.VIDEO], noise[SegmentKind.VIDEO])


def test_keyframe_noise_of_the_official_recipe():
    """SGLang's `condition_noise.py`: each keyframe's noise from a fresh CPU generator seeded with the seed,
    drawn as [1, 24, T + n_keyframes, h, w] and cut to its first latent frame (so both keyframes share
    it); video and audio as without keyframes."""
    from diffusers.modular_pipelines.minimax_h3.before_denoise import patchify_video_latents

    shape = preset("tiny").video_shape(256, 128, 22, keyframes=("first", "last"))
    noise = initial_noise(42, shape)
    drawn = torch.randn(1, 24, 7 + 2, 8, 16, generator=torch.Generator().manual_seed(42))[:, :, :1]
    frame = patchify_video_latents(drawn, (1, 2, 2))
    assert torch.equal(noise[SegmentKind.CONDITION], torch.cat([frame, frame]))
    assert torch.equal(noise[SegmentKind.VIDEO], initial_noise(42, preset("tiny").video_shape(256, 128, 22))[SegmentKind.VIDEO])
    one = initial_noise(42, preset("tiny").video_shape(256, 128, 22, keyframes=("last",)))[SegmentKind.CONDITION]
    assert one.shape == (32, 96) and not torch.equal(one, frame)  # T + 1 frames drawn: another cut of the stream


@pytest.mark.parametrize("anchors", [(), ("first",), ("first", "last")])
def test_the_diffusers_recipe_draws_keyframes_video_then_audio_from_one_generator(anchors):
    """diffusers 0.42.1's order: `MiniMaxH3PrepareConditionLatentsStep` (one draw of a condition's shape
    per keyframe), then `MiniMaxH3PrepareLatentsStep` (video latent, then audio rows), one generator."""
    from diffusers.modular_pipelines.minimax_h3.before_denoise import patchify_video_latents
    from diffusers.utils.torch_utils import randn_tensor

    shape = preset("tiny").video_shape(256, 128, 22, keyframes=anchors)
    noise = initial_noise(7, shape, NoiseRecipe.DIFFUSERS)
    generator = torch.Generator().manual_seed(7)
    conditions = [randn_tensor((1, 24, 1, 8, 16), generator=generator, dtype=torch.float32) for _ in anchors]
    video = randn_tensor((1, 24, 7, 8, 16), generator=generator, dtype=torch.float32)
    audio = randn_tensor((2 * 37, 32), generator=generator, dtype=torch.float32)
    assert torch.equal(noise[SegmentKind.VIDEO], patchify_video_latents(video, (1, 2, 2)))
    assert torch.equal(noise[SegmentKind.AUDIO], audio)
    if anchors:
        assert torch.equal(noise[SegmentKind.CONDITION], torch.cat([patchify_video_latents(c, (1, 2, 2)) for c in conditions]))
    else:
        assert SegmentKind.CONDITION not in noise
    official = initial_noise(7, shape)
    assert not torch.equal(official[SegmentKind.AUDIO], noise[SegmentKind.AUDIO])  # whose noise a seed means differs


def test_condition_rows_are_mixed_as_diffusers_scale_noise():
    from diffusers import MiniMaxH3Scheduler

    clean, noise = torch.randn(2, 24, 1, 4, 6), torch.randn(2, 24, 1, 4, 6)
    expected = MiniMaxH3Scheduler().scale_noise(clean, 0.999, noise)
    assert torch.equal(noised_condition(clean, noise), expected)


def test_shifted_sigmas_by_hand():
    # 5 points, shift 3: base 1, .75, .5, .25, 0 -> 3b / (1 + 2b)
    assert shifted_sigmas(5, 3.0).tolist() == pytest.approx([1.0, 2.25 / 2.5, 1.5 / 2.0, 0.75 / 1.5, 0.0], abs=1e-7)
    with pytest.raises(ValueError, match="at least 2 sigma points"):
        shifted_sigmas(1, 3.0)


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
        check_finite({"video": torch.full((2, 2), float("nan")), "audio": bad}, step=1, steps=2)
