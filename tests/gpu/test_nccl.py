"""The CUDA path: device policy on a real GPU, NCCL collectives and faults (>= 2 GPUs), bench-transport.

Skipped, with the reason, on machines without CUDA (or with fewer GPUs than a test needs).
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from h3core.errors import RankFailure
from h3core.parallel.collectives import gather_rows, head_to_seq, reduce_scatter_rows, seq_to_head
from h3core.parallel.partition import balanced_spans, head_spans, token_spans
from h3core.runtime import device
from h3core.runtime.faults import FAULT_ENV, maybe_inject_fault
from h3core.runtime.world import World

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
needs_two = pytest.mark.skipif(GPUS < 2, reason="needs at least 2 GPUs for NCCL")


def _full(seed, shape, dtype=torch.bfloat16):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _ulysses(ctx, num_tokens, num_heads, head_dim):
    tokens, heads = token_spans(num_tokens, ctx.world_size), head_spans(num_heads, ctx.world_size)
    full = _full(3, (num_tokens, 3, num_heads, head_dim)).to(ctx.device)
    local = full[tokens[ctx.rank].start : tokens[ctx.rank].stop]
    by_head = seq_to_head(local, tokens, heads, ctx.group)
    back = head_to_seq(by_head, tokens, heads, ctx.group)
    return {"by_head": by_head, "exact": bool(torch.equal(back, local)), "device": str(by_head.device)}


def _rows(ctx, num_rows, width):
    rows = balanced_spans(num_rows, ctx.world_size)
    full = _full(5, (num_rows, width)).to(ctx.device)
    gathered = gather_rows(full[rows[ctx.rank].start : rows[ctx.rank].stop], rows, ctx.group)
    partial = _full(50 + ctx.rank, (num_rows, width)).to(ctx.device)
    return {"gathered": gathered, "reduced": reduce_scatter_rows(partial, rows, ctx.group)}


def _steps(ctx, steps):
    value = torch.ones(1, device=ctx.device)
    for step in range(steps):
        maybe_inject_fault("step", ctx.rank, step)
        torch.distributed.all_reduce(value, group=ctx.group)
    return value


@pytest.fixture(scope="module")
def nccl_world():
    with World(min(GPUS, 8), "cuda", timeout_s=120) as world:
        yield world


def test_device_policy_on_cuda():
    assert device.resolve_device("auto") == "cuda"
    assert device.compute_dtype("cuda") is torch.bfloat16
    cuda0 = torch.device("cuda", 0)
    device.reset_peak_memory(cuda0)
    base = device.peak_memory_bytes(cuda0)
    a = torch.randn(4096, 4096, device=cuda0, dtype=torch.bfloat16)
    with device.Stopwatch(cuda0) as watch:
        for _ in range(10):
            a = a @ a.T / 4096
    assert watch.seconds > 0
    assert device.peak_memory_bytes(cuda0) - base >= 4096 * 4096 * 2


@needs_two
def test_nccl_transport_is_exact_and_matches_reference(nccl_world):
    num_tokens, num_heads, head_dim = 1001, 56, 128
    results = nccl_world.run(_ulysses, num_tokens, num_heads, head_dim)
    full = _full(3, (num_tokens, 3, num_heads, head_dim))
    heads = head_spans(num_heads, nccl_world.world_size)
    for rank, result in enumerate(results):
        assert result["exact"] and result["device"] == f"cuda:{rank}"
        assert torch.equal(result["by_head"], full[..., heads[rank].start : heads[rank].stop, :])


@needs_two
def test_nccl_ragged_rows(nccl_world):
    size = nccl_world.world_size
    num_rows, width = 3 * size + 1, 96
    results = nccl_world.run(_rows, num_rows, width)
    partials = [_full(50 + r, (num_rows, width)) for r in range(size)]
    total = partials[0].float()
    for partial in partials[1:]:
        total = total + partial.float()
    rows = balanced_spans(num_rows, size)
    for rank, result in enumerate(results):
        assert torch.equal(result["gathered"], _full(5, (num_rows, width)))
        assert torch.equal(result["reduced"], total[rows[rank].start : rows[rank].stop].to(torch.bfloat16))


@needs_two
def test_nccl_killed_rank_stops_the_world(monkeypatch):
    monkeypatch.setenv(FAULT_ENV, "step:3@1:kill")
    with World(2, "cuda", timeout_s=60) as world:
        pids = world.pids
        with pytest.raises(RankFailure, match="rank 1 failed: process killed by signal SIGKILL"):
            world.run(_steps, 6)
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_bench_transport_one_rank_on_cuda():
    proc = subprocess.run(
        [sys.executable, "-m", "h3cli.main", "bench-transport", "1", "--tokens", "4096", "--device", "cuda", "--iters", "5", "--json"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["config"]["dtype"] == "bf16" and report["identity_exact"] and report["ratio"] is None
    assert report["phases"]["attention"]["median_s"] > 0


@needs_two
def test_bench_transport_nccl_ratio_is_reported():
    proc = subprocess.run(
        [sys.executable, "-m", "h3cli.main", "bench-transport", str(min(GPUS, 8)), "--tokens", "8192", "--device", "cuda", "--json"],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["backend"] == "nccl" and report["identity_exact"] and report["ratio"] > 0
