"""The dry run: a rank's own load and denoise code on fake tensors at H3's real widths (`h3-2blocks`),
on both GPU paths, and its CPU prediction against the same code on real CPU tensors."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch

from h3core.generate import dryrun
from h3core.model.config import preset
from h3core.model.synthetic import synthetic_checkpoint
from h3core.nvfp4.matmul import PATH_CUDA_BF16
from h3core.parallel.plan import Mode, ParallelPlan
from h3core.runtime import fake_cuda

GUARD = dryrun.dry_run_problem("sm_120")
# only a machine without a C++ compiler skips; a guard that does not build or load fails the tests
needs_guard = pytest.mark.skipif(GUARD == fake_cuda.NO_COMPILER, reason=f"no fake CUDA here: {GUARD}")


def _run(name: str, count: int, mode: Mode, arch: str, decoded: str = "off"):  # type: ignore[no-untyped-def]
    return dryrun.preset_run(ParallelPlan.for_preset(name, count, mode), name, arch, decoded_weights=decoded)


@needs_guard
@pytest.mark.parametrize(("mode", "count", "arch"), [(Mode.ULYSSES, 1, "sm_120"), (Mode.ULYSSES, 1, "sm_90"), (Mode.TENSOR, 2, "sm_120")])
def test_the_rank_code_runs_at_h3_widths_on_fake_cuda(mode, count, arch):
    result = dryrun.dry_run(_run("h3-2blocks", count, mode, arch), arch)
    assert len(result.peaks()) == count
    for rank in result.ranks:
        assert rank.nvfp4_paths and set(rank.nvfp4_paths) == {dryrun.ARCHS[arch].nvfp4_path}
        assert set(rank.attention_kernels) == {"sdpa:flash_attention"}  # never the math kernel's scores
        assert rank.resident_after_load >= rank.weights.resident > 0  # the weights are device storage
        assert len(set(rank.live_after_steps)) == 1  # nothing grows from step to step
        assert rank.peak_sampling > rank.live_after_steps[0] > rank.weights.resident
        # the CUDA path's only host sync in the loop: check_finite, once per step (by design)
        loop = [s for s in rank.host_syncs if s.phase == "sampling"]
        assert [(s.where.split()[-1], s.count) for s in loop] == [("check_finite", len(rank.live_after_steps))]
    if mode == Mode.TENSOR:
        assert all(r.weights.block_share < 0.6 for r in result.ranks)


@needs_guard
def test_hopper_decoded_weights_are_held_and_counted():
    off = dryrun.dry_run(_run("h3-2blocks", 1, Mode.ULYSSES, "sm_90", "off"), "sm_90").ranks[0]
    run = _run("h3-2blocks", 1, Mode.ULYSSES, "sm_90", "on")
    on = dryrun.dry_run(run, "sm_90").ranks[0]
    cost = run.plan.decoded.bytes_per_rank[0]
    assert run.plan.decoded.held and run.plan.decoded.count == 8
    assert on.weights.resident - off.weights.resident == cost  # 2 bytes per weight of every NVFP4 linear
    assert on.nvfp4_paths == off.nvfp4_paths and set(on.nvfp4_paths) == {PATH_CUDA_BF16}
    assert dryrun.dry_run(_run("h3-2blocks", 1, Mode.ULYSSES, "sm_120", "auto"), "sm_120").ranks[0].weights.resident < off.weights.resident + 1


def test_cpu_prediction_equals_the_real_cpu_run():
    """tiny at one rank: the fake run's peak and live bytes against the same code on real tensors."""
    run = _run("tiny", 1, Mode.ULYSSES, "cpu")
    run = run.model_copy(update={"checkpoint": synthetic_checkpoint(preset("tiny"))[0]})
    predicted = dryrun.dry_run(run, "cpu").ranks[0]
    measured = dryrun.measured_cpu_run(run)
    assert predicted.resident_after_load == measured.resident_after_load
    # the fake run also holds a host tensor it computed for real (the position ids: under 24 bytes a row)
    extra = {p - m for p, m in zip(predicted.live_after_steps, measured.live_after_steps)}
    assert len(extra) == 1 and 0 <= extra.pop() <= 24 * run.plan.num_tokens
    assert 0 <= predicted.peak_sampling - measured.peak_sampling <= 24 * run.plan.num_tokens


def test_fake_cuda_needs_the_guard_on_a_cpu_build():
    """What the guard is for: without it (a fresh process), moving a tensor to CUDA under FakeTensorMode fails."""
    if torch.backends.cuda.is_built():
        pytest.skip("a CUDA build has its own device guard")
    code = ("import torch\nfrom torch._subclasses.fake_tensor import FakeTensorMode\n"
            "with FakeTensorMode(allow_non_fake_inputs=True):\n    torch.zeros(2).to('cuda')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "not linked with support for cuda" in done.stderr


# --- a seam broken on purpose: the failure surfaces, in one line, and the memory check says so -------------


def _broken_host(run, device, tracker, fake, capability):
    """The dry run's own instruments with one seam broken: host arithmetic left on fake tensors, whose
    values (the sigma schedule's `unique_consecutive`, a step's distinct timesteps) do not exist."""
    from dataclasses import replace

    from h3core.generate.dryrun.fakes import fake_instruments
    from h3core.generate.instruments import on_host

    return replace(fake_instruments(run, device, tracker, fake, capability), host=on_host)


@needs_guard
def test_a_broken_seam_fails_the_dry_run_in_one_line_and_the_memory_check_says_so():
    from h3core.errors import DryRunFailed

    run = _run("tiny", 1, Mode.ULYSSES, "sm_90")
    with pytest.raises(DryRunFailed) as failed:
        dryrun.dry_run(run, "sm_90", fakes=_broken_host)
    line = str(failed.value)
    assert "\n" not in line  # which rank, what, and the h3 line it failed at (the schedule's `unique_consecutive`)
    assert re.fullmatch(r"the dry run of rank 0 \(sm_90\) failed: DynamicOutputShapeException: aten\.\w+\.default \(at h3core/model/sampler\.py:\d+ \w+\)", line), line
    check, predicted = dryrun.check_device_memory(run, arch="sm_90", usable_bytes=80 << 30, dry=lambda r, a: dryrun.dry_run(r, a, fakes=_broken_host))
    assert predicted is None and check.model == "formula" and check.failed
    assert check.line.startswith(line) and "the memory formula (a lower bound) checked instead" in check.line


@needs_guard
def test_the_dry_run_decides_the_gpus_memory():
    from h3core.errors import ResourceLimit

    run = _run("tiny", 2, Mode.TENSOR, "sm_120")
    check, predicted = dryrun.check_device_memory(run, arch="sm_120", usable_bytes=80 << 30)
    assert check.model == "dry run" and not check.failed and check.peak_bytes == max(predicted.peaks())
    with pytest.raises(ResourceLimit, match=r"the dry run of this run's own code predicts a peak of .* on rank \d, but a GPU here has"):
        dryrun.check_device_memory(run, arch="sm_120", usable_bytes=check.peak_bytes - 1)


@needs_guard
def test_ranks_simulated_once_predict_what_each_rank_simulated_predicts(mode=Mode.TENSOR):
    """Issue 35.5: ranks whose shapes are the same are simulated once (`same_as`); every rank's
    prediction is the one its own simulation gives (tensor mode at 6 ranks: shards at 6 positions,
    two sequence lengths)."""
    from h3core.generate.dryrun.predict import _distinct_ranks, _rank_dry_run, _short

    run = _run("h3-2blocks", 6, mode, "sm_90")
    fast = dryrun.dry_run(run, "sm_90")
    assert len(fast.ranks) < 6
    assert sorted([r.rank for r in fast.ranks] + [o for r in fast.ranks for o in r.same_as]) == list(range(6))
    by_rank = {r.rank: r for r in fast.ranks} | {o: r for r in fast.ranks for o in r.same_as}
    short = _short(run, dryrun.DEFAULT_STEPS)
    for rank in range(6):
        alone = _rank_dry_run(short, "sm_90", rank)
        shared = by_rank[rank]
        assert (alone.peak_load, alone.peak_sampling, alone.peak_total, alone.resident_after_load, alone.live_after_steps) == (
            shared.peak_load, shared.peak_sampling, shared.peak_total, shared.resident_after_load, shared.live_after_steps), rank
        assert alone.weights.resident == shared.weights.resident and alone.fp4_gemm_shapes == shared.fp4_gemm_shapes
    assert len(_distinct_ranks(run)) == len(fast.ranks)
    # the groups differ where it matters: merging them (a key that ignores the rows) would be caught above
    assert len({(r.peak_sampling, r.peak_load) for r in fast.ranks}) > 1
