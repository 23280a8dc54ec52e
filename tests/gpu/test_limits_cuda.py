"""Limits on CUDA: each rank's need against its GPU, decided before any rank starts; the estimate is a
lower bound of the CUDA allocator's measured peak. Skipped without a GPU."""

from __future__ import annotations

import math

import pytest
import torch

from h3core.errors import ResourceLimit
from h3core.generate.memory import generate_need
from h3core.generate.pipeline import rank_generate
from h3core.generate.request import GenerateRequest, resolve
from h3core.parallel.modes import Mode
from h3core.parallel.plan import ParallelPlan
from h3core.runtime.limits import CUDA_CONTEXT_BYTES, capacity

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_capacity_is_each_gpus_memory_less_a_context():
    have = capacity("cuda", 1)
    assert have.gpu_bytes == [torch.cuda.get_device_properties(0).total_memory - CUDA_CONTEXT_BYTES]


def test_a_run_no_gpu_can_hold_is_refused_before_any_rank_starts():
    with pytest.raises(ResourceLimit, match="of GPU memory per rank"):
        resolve(GenerateRequest(preset="tiny", width=400_000, height=400_000, steps=2, device="cuda"))


def test_the_estimate_is_a_lower_bound_of_the_allocator_peak():
    from h3core.runtime.world import World

    run = resolve(GenerateRequest(preset="h3-2blocks", steps=2, device="cuda"))
    text = min(len(run.request.prompt.encode()), run.config.max_text_tokens)
    plan = ParallelPlan.build(run.config, 1, Mode.ULYSSES, run.config.segments(run.shape.width, run.shape.height, run.shape.frames, text))
    elements = math.prod(run.shape.video_latent) + math.prod(run.shape.audio_latent)
    need = generate_need(run.config, plan, elements, 2, "cuda", torch.bfloat16, "sdpa", spawned=False)
    with World(1, "cuda") as world:
        (outcome,) = world.run(rank_generate, run)
    # the allocator's peak while sampling counts everything allocated then: weights, RoPE table, activations
    assert sum(need.on_device.values()) <= outcome.peak_memory_sampling_bytes, need.describe()
