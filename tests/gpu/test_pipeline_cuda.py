"""The generate pipeline on CUDA: bf16, NCCL, fused attention, per-rank paths, memory released
after in-process runs. Skipped without a GPU."""

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from h3core.generate.parity import latent_parity, run_tolerance
from h3core.generate.pipeline import rank_generate
from h3core.generate.request import GenerateRequest, resolve
from h3core.generate.run import execute
from collections import Counter

from h3core.model.attention import attend, is_math_kernel
from h3core.parallel.modes import Mode
from h3core.runtime.world import World

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _run(mode: Mode, world_size: int):
    run = resolve(GenerateRequest(preset="narrow", steps=2, mode=mode, world_size=world_size, device="cuda"))
    with World(world_size, "cuda") as world:
        return world.run(rank_generate, run)


def test_one_gpu_both_modes_are_bit_identical_in_bf16():
    (u,), (t,) = _run(Mode.ULYSSES, 1), _run(Mode.TENSOR, 1)
    assert torch.equal(u.video, t.video) and torch.equal(u.audio, t.audio)
    assert u.peak_memory_sampling_bytes > 0
    assert u.nvfp4_paths and all(path.startswith("cuda-") for path in u.nvfp4_paths)
    assert u.attention_kernels and all(k.startswith("sdpa:") and not is_math_kernel(k) for k in u.attention_kernels)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
@pytest.mark.parametrize("mode", list(Mode))
def test_two_gpus_match_one_within_the_bf16_tolerance(mode):
    (one,) = _run(mode, 1)
    two = _run(mode, 2)[0]
    tol = run_tolerance(mode, torch.bfloat16, two.nvfp4_paths)
    parity = latent_parity({"video": two.video, "audio": two.audio}, {"video": one.video, "audio": one.audio}, tol, "1 GPU")
    assert parity.passed, parity


FUSED_CUDA = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]


@pytest.mark.parametrize("heads", [56, 7])  # H3 at one rank and at 8 ranks
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_sdpa_runs_a_fused_kernel_at_h3_shapes_on_cuda(heads, dtype):
    qkv = torch.randn(2048, 3, heads, 128, device="cuda", dtype=dtype)  # [S, 3, H, Dh] as Ulysses receives it
    q, k, v = qkv.unbind(1)
    record: Counter[str] = Counter()
    with sdpa_kernel(FUSED_CUDA):  # a math fallback raises here
        out = attend(q, k, v, "sdpa", record)
    assert out.shape == q.shape and torch.isfinite(out).all()
    (kernel,) = record
    assert not is_math_kernel(kernel), kernel


def test_an_in_process_run_leaves_nothing_on_the_gpu():
    """One-rank cells and parity references run in the launching process on cuda:0: afterwards its
    allocations and the caching allocator's cache are back to what they were before."""
    run = resolve(GenerateRequest(preset="narrow", steps=2, device="cuda"))
    execute(run)  # warm-up: lookup tables and CUDA context that any process keeps
    torch.cuda.synchronize()
    allocated, reserved = torch.cuda.memory_allocated(0), torch.cuda.memory_reserved(0)
    (outcome,) = execute(run)
    assert outcome.peak_memory_sampling_bytes > 0
    assert torch.cuda.memory_allocated(0) == allocated
    assert torch.cuda.memory_reserved(0) <= reserved


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability(0) < (10, 0), reason="the fp4 GEMM needs Blackwell")
def test_a_generate_run_self_tests_exactly_the_fp4_gemms_its_ranks_call(tmp_path):
    """`h3 generate` on a Blackwell GPU: the launcher's self-test (h3core.generate.fp4gate) checked the
    shapes the dry run predicted, and those are every fp4 GEMM the rank then ran."""
    from h3core.generate.request import GenerateJob
    from h3core.generate.run import generate

    report = generate(GenerateJob(request=GenerateRequest(preset="narrow", steps=2, device="cuda"), output=tmp_path / "run", decode=False))
    (record,) = report.fp4_selftest.values()
    assert record.accepted, record.reason
    assert report.ranks[0].fp4_gemm_shapes and report.fp4_untested_shapes == []
    assert report.ranks[0].nvfp4_paths.keys() == {"cuda-fp4-scaled-mm"}
