"""A few sampling steps of h3's loop equal diffusers 0.42.1's on the same weights, noise and text.

The reference loop is diffusers' own pieces, as its modular pipeline strings them together
(`MiniMaxH3PrepareLayoutStep`, `MiniMaxH3SetTimestepsStep.build_row_timesteps`, the transformer,
`MiniMaxH3Scheduler.step` for video at shift 12 and audio at shift 3, `denoise.py`'s order). h3's
side is the real one-rank pipeline: the checkpoint loaded by h3, `build_sequence` (text refined
once), the `Denoiser` and `denoise` loop with its two `FlowMatchH3` schedules. fp32, bound 1e-5.
"""

from __future__ import annotations

import pytest
import torch

import h3_reference as ref
from h3core.generate.loop import Denoiser, denoise
from h3core.generate.request import GenerateRequest, RunShape
from h3core.generate.sequences import build_sequence
from h3core.model.checkpoint import Checkpoint
from h3core.model.config import preset
from h3core.model.sampler import FlowMatchH3, initial_noise
from h3core.model.sequence import SegmentKind
from h3core.parallel.modes import Mode
from h3core.parallel.plan import ParallelPlan
from h3core.parallel.runtime import ParallelRuntime
from h3core.runtime.device import DeviceMeter

TEXT, POINTS, SEED = 9, 5, 11


def _diffusers_loop(model, text: torch.Tensor, noise: dict, shape: RunShape) -> tuple[torch.Tensor, torch.Tensor]:
    from diffusers import MiniMaxH3Scheduler
    from diffusers.modular_pipelines.minimax_h3.before_denoise import MiniMaxH3PrepareLayoutStep, MiniMaxH3SetTimestepsStep

    layout = MiniMaxH3PrepareLayoutStep.build_packed_sequence(
        torch.ones(TEXT, dtype=torch.long), shape.latent_frames, shape.latent_height, shape.latent_width, shape.audio_latents,
        (1, 2, 2), 2, 2, 0,
    )
    position_ids, token_tags, video_indices, audio_indices, text_indices, cond_v, cond_a = layout
    video_sched, audio_sched = MiniMaxH3Scheduler(shift=12.0), MiniMaxH3Scheduler(shift=3.0)
    video_sched.set_timesteps(POINTS)
    audio_sched.set_timesteps(POINTS)
    video, audio = noise[SegmentKind.VIDEO].clone(), noise[SegmentKind.AUDIO].clone()
    for i, (t, t_audio) in enumerate(zip(video_sched.timesteps, audio_sched.timesteps)):
        timestep, timestep_indices = MiniMaxH3SetTimestepsStep.build_row_timesteps(
            video_indices, audio_indices, cond_v, cond_a, TEXT, float(t), float(t_audio), max(float(t), 0.999), 1.0)
        with torch.no_grad():
            v, a = model(hidden_states=video[None], audio_hidden_states=audio[None], encoder_hidden_states=text[None],
                         timestep=timestep, timestep_indices=timestep_indices, token_tags=token_tags, position_ids=position_ids,
                         video_indices=video_indices, audio_indices=audio_indices, text_indices=text_indices, return_dict=False)
        video = video_sched.step(v[0].float(), t, video, return_dict=False)[0]
        audio = audio_sched.step(a[0].float(), audio_sched.timesteps[i], audio, return_dict=False)[0]
    return video, audio


def _h3_loop(path, text: torch.Tensor, noise: dict) -> tuple[torch.Tensor, torch.Tensor, RunShape]:
    ckpt = Checkpoint.open(path, preset("tiny"))
    model = ckpt.load()
    config = ckpt.config
    shape = RunShape.of(config, GenerateRequest(steps=POINTS))
    plan = ParallelPlan.build(config, 1, Mode.ULYSSES, config.segments(shape.width, shape.height, shape.frames, TEXT))
    runtime = ParallelRuntime(plan, 0, None)
    schedules = {SegmentKind.VIDEO: FlowMatchH3(shape.video_shift), SegmentKind.AUDIO: FlowMatchH3(shape.audio_shift)}
    for schedule in schedules.values():
        schedule.set_timesteps(POINTS)
    with torch.inference_mode():
        sequences = [build_sequence(model, plan.sequences[0], text, shape, torch.device("cpu"))]
        denoiser = Denoiser(model, runtime, sequences, 1.0, schedules)
        latent, seconds = denoise(denoiser, denoiser.own_rows(noise, torch.device("cpu")), DeviceMeter("cpu"), None, lambda *a: None)
    assert len(seconds) == POINTS - 1  # N sigma points: N - 1 forwards
    return latent[SegmentKind.VIDEO], latent[SegmentKind.AUDIO], shape


@pytest.mark.parametrize("pruned", [False, True], ids=["full", "pruned"])
def test_sampling_steps_equal_diffusers_loop(tmp_path, pruned):
    model = ref.random_model(seed=21)
    state = ref.original_state(model)
    if pruned:
        state = ref.pruned_state(state, ref.prune(model))
    path = ref.write_single(tmp_path / "h3.safetensors", state)
    text = torch.randn(TEXT, model.config.text_dim, generator=torch.Generator().manual_seed(2))
    shape = RunShape.of(preset("tiny"), GenerateRequest(steps=POINTS))
    noise = initial_noise(SEED, shape)
    video, audio, _ = _h3_loop(path, text, noise)
    expected_video, expected_audio = _diffusers_loop(model, text, noise, shape)
    errors = ref.relative_error(video, expected_video), ref.relative_error(audio, expected_audio)
    print(f"{'pruned' if pruned else 'full'}, {POINTS - 1} steps: video {errors[0]:.2e}, audio {errors[1]:.2e}")
    assert max(errors) <= 1e-5
    assert ref.relative_error(video, noise[SegmentKind.VIDEO]) > 0.01  # the loop moved the latents
