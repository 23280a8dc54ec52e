"""The generate pipeline on CUDA: bf16, NCCL, peak memory. Skipped without a GPU."""

import pytest
import torch

from h3core.launch import World
from h3core.parity import latent_parity, tolerance
from h3core.pipeline import GenerateRequest, rank_generate, resolve
from h3core.plan import Mode

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _run(mode: Mode, world_size: int):
    run = resolve(GenerateRequest(preset="narrow", steps=2, mode=mode, world_size=world_size, device="cuda"))
    with World(world_size, "cuda") as world:
        return world.run(rank_generate, run)


def test_one_gpu_both_modes_are_bit_identical_in_bf16():
    (u,), (t,) = _run(Mode.ULYSSES, 1), _run(Mode.TENSOR, 1)
    assert torch.equal(u.video, t.video) and torch.equal(u.audio, t.audio)
    assert u.peak_memory_sampling > 0
    assert u.linear_path.startswith("cuda-")
    assert u.attention_kernel.startswith("sdpa:")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
@pytest.mark.parametrize("mode", list(Mode))
def test_two_gpus_match_one_within_the_bf16_tolerance(mode):
    (one,) = _run(mode, 1)
    two = _run(mode, 2)[0]
    parity = latent_parity({"video": two.video, "audio": two.audio}, {"video": one.video, "audio": one.audio}, tolerance(mode, torch.bfloat16), "1 GPU")
    assert parity.passed, parity
