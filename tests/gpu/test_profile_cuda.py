"""CUDA: the profile's event timing, and RoPE into send blocks in bf16. Skipped without a GPU."""

import pytest
import torch

from h3core.generate.pipeline import rank_generate
from h3core.generate.request import GenerateRequest, resolve
from h3core.parallel.modes.ulysses import ProjectedQKV
from h3core.parallel.collectives import send_blocks
from h3core.parallel.partition import head_spans
from h3core.parallel.modes import Mode
from h3core.runtime.world import World

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_rope_into_send_blocks_is_bitwise_in_bf16_on_cuda():
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(300, 56, 128, device="cuda", generator=g).bfloat16() for _ in range(3))
    angles = torch.rand(300, 64, device="cuda", generator=g) * 40
    p = ProjectedQKV(q, k, v, angles.cos(), angles.sin())
    heads = head_spans(56, 6)  # ragged: 10,10,9,9,9,9
    blocks = send_blocks(300, (3,), 128, heads, v)
    for head_range, view in blocks.pieces:
        p.write(head_range, view)
    finished = torch.stack(p.split(), dim=1)
    expected = torch.cat([finished[:, :, h.start : h.stop].reshape(-1) for h in heads])
    assert torch.equal(blocks.buffer, expected)


def test_profile_on_cuda_uses_events_and_adds_up():
    run = resolve(GenerateRequest(preset="narrow", steps=3, mode=Mode.ULYSSES, world_size=1, device="cuda", profile=True))  # 3 sigma points: 2 forwards
    with World(1, "cuda") as world:
        (outcome,) = world.run(rank_generate, run)
    profile = outcome.profile
    assert profile.clock == "cuda events" and len(profile.steps) == 2
    for split in profile.steps:
        assert abs(sum(v for k, v in split.items() if k != "step") - split["step"]) < 1e-6
        assert split["attention"] > 0 and split["nvfp4_linears"] > 0
    assert profile.steps[1]["step"] <= outcome.step_seconds[1] * 1.01
