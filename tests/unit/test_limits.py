"""h3core.runtime.limits and the needs it checks (h3core.generate.memory, bench-transport's): what a run needs
per rank, from its plan, against what the machine has (CPU-checkable, GPU decisions included)."""

from __future__ import annotations

import math

import pytest
import torch

import h3core.runtime.limits as limits
from h3core.bench.transport import transport_need
from h3core.errors import ResourceLimit
from h3core.generate.memory import STEP_BYTES, generate_need
from h3core.model.attention import scores_bytes
from h3core.model.config import preset
from h3core.parallel.modes import Mode
from h3core.parallel.plan import ParallelPlan
from h3core.runtime.limits import Capacity, MemoryNeed, check_cpu_ranks, check_memory

TINY = preset("tiny")


def _need(cfg=TINY, ranks=1, mode=Mode.ULYSSES, size=(256, 128, 22), steps=4, attention="sdpa", device="cpu", dtype=torch.float32):
    w, h, f = size
    plan = ParallelPlan.build(cfg, ranks, mode, cfg.segments(w, h, f, 16))
    shape = cfg.video_shape(w, h, f)
    elements = math.prod(shape.video_latent) + math.prod(shape.audio_latent)
    return generate_need(cfg, plan, elements, steps, device, dtype, attention, spawned=ranks > 1), plan


def test_the_need_follows_the_plan():
    one, plan = _need()
    s, d = plan.num_tokens, TINY.hidden
    assert one.on_device["rope"] == s * TINY.rotary_dim * 4 + s * 3 * 8
    assert one.on_device["activations"] >= s * 4 * TINY.attention_width * 4  # one rank: q|k|v and the output of every head, fp32
    assert one.on_host["steps"] == 4 * STEP_BYTES and "process" not in one.on_host  # runs in this process
    four, _ = _need(ranks=4)
    assert four.on_device["activations"] < one.on_device["activations"] and four.on_host["process"] == limits.PROCESS_BYTES
    assert four.host_total() == 4 * (sum(four.on_device.values()) + sum(four.on_host.values()))
    ulysses, _ = _need(cfg=preset("narrow"), ranks=4, size=(256, 160, 22))
    tensor, _ = _need(cfg=preset("narrow"), ranks=4, mode=Mode.TENSOR, size=(256, 160, 22))
    assert tensor.on_device["weights"] < ulysses.on_device["weights"]  # each rank holds a share of the block linears


def test_attention_scores_are_counted_where_the_kernel_materialises_them(monkeypatch):
    from h3core.model.attention import dispatch as attention

    s, h, dh = 1000, 8, 16
    assert scores_bytes("math", "cpu", torch.float32, h, s, dh) == 2 * 4 * h * s * s
    assert scores_bytes("sdpa", "cuda", torch.bfloat16, h, s, dh) == 0  # fused on a GPU; decided without CUDA
    assert scores_bytes("sage2", "cuda", torch.bfloat16, h, s, dh) == 0
    # sdpa on a CPU: what the dispatcher picks for the real call's inputs decides
    monkeypatch.setattr(attention, "planned_sdpa_kernel", lambda *a: "sdpa:math")
    assert scores_bytes("sdpa", "cpu", torch.float32, h, s, dh) == 2 * 4 * h * s * s
    monkeypatch.setattr(attention, "planned_sdpa_kernel", lambda *a: "sdpa:flash_attention")
    assert scores_bytes("sdpa", "cpu", torch.float32, h, s, dh) == 0


def test_the_planned_kernel_is_what_a_real_sdpa_call_records():
    from collections import Counter

    from h3core.model.attention import attend, planned_sdpa_kernel

    qkv = torch.randn(40, 3, 8, 16)  # [S, 3, H, Dh], q, k, v strided as the model's
    record: Counter[str] = Counter()
    attend(qkv[:, 0], qkv[:, 1], qkv[:, 2], "sdpa", record)
    assert list(record) == [planned_sdpa_kernel(torch.device("cpu"), torch.float32, 8, 16)]


def test_a_need_that_does_not_fit_is_one_line_with_the_largest_part_and_advice():
    need = MemoryNeed(ranks=8, device="cpu", on_device={"activations": 3 << 30, "weights": 1 << 30}, on_host={"process": 128 << 20})
    with pytest.raises(ResourceLimit) as err:
        check_memory(need, Capacity(host_bytes=16 << 30, host_source="MemAvailable"), "--width/--height/--frames")
    text = str(err.value)
    assert "\n" not in text and "needs at least 33 GiB of memory (8 ranks x 4.12 GiB)" in text
    assert "activations 3 GiB, weights 1 GiB, process 128 MiB per rank" in text and "use a smaller --width/--height/--frames" in text
    check_memory(need, Capacity(host_bytes=64 << 30, host_source="MemAvailable"), "--width")  # fits
    check_memory(need, Capacity(host_bytes=None, host_source=""), "--width")  # unknown: not refused


def test_on_cuda_each_rank_must_fit_its_gpu_and_the_host_the_rest():
    need = MemoryNeed(ranks=2, device="cuda", on_device={"weights": 20 << 30, "activations": 30 << 30}, on_host={"latents": 1 << 30})
    with pytest.raises(ResourceLimit, match=r"needs at least 50 GiB of GPU memory per rank \(activations 30 GiB, weights 20 GiB\) but a GPU here has 47.8 GiB usable"):
        check_memory(need, Capacity(host_bytes=1 << 40, host_source="MemAvailable", gpu_bytes=[48 << 30, (48 << 30) - (200 << 20)]), "--width")
    check_memory(need, Capacity(host_bytes=1 << 40, host_source="MemAvailable", gpu_bytes=[80 << 30, 80 << 30]), "--width")
    with pytest.raises(ResourceLimit, match="of memory"):  # the GPUs hold it, the host does not hold the ranks' host parts
        check_memory(need, Capacity(host_bytes=1 << 30, host_source="MemAvailable", gpu_bytes=[80 << 30] * 2), "--width")


def test_advice_names_what_to_change():
    steps = MemoryNeed(ranks=1, device="cpu", on_host={"steps": 60 << 30})
    with pytest.raises(ResourceLimit, match="use fewer --steps"):
        check_memory(steps, Capacity(host_bytes=1 << 30, host_source="MemAvailable"), "--width")
    weights = MemoryNeed(ranks=1, device="cuda", on_device={"weights": 60 << 30})
    with pytest.raises(ResourceLimit, match="use tensor mode or more GPUs"):
        check_memory(weights, Capacity(host_bytes=1 << 40, host_source="x", gpu_bytes=[40 << 30]), "--width")


def test_cpu_rank_cap_and_its_override(monkeypatch):
    check_cpu_ranks(64)
    with pytest.raises(ResourceLimit, match="65 CPU ranks asked for, but h3 starts at most 64 .* set H3_MAX_CPU_RANKS=65"):
        check_cpu_ranks(65)
    monkeypatch.setenv("H3_MAX_CPU_RANKS", "500")
    check_cpu_ranks(500)


def test_transport_need_scales_with_tokens_and_heads():
    small = transport_need(1000, 56, 128, 2, "cpu", torch.float32, None)
    large = transport_need(4000, 56, 128, 2, "cpu", torch.float32, None)
    assert large.on_device["activations"] == 4 * small.on_device["activations"]
    assert small.on_host["process"] == limits.PROCESS_BYTES and "process" not in transport_need(10, 2, 16, 1, "cpu", torch.float32, None).on_host
