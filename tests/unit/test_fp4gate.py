"""The fp4 GEMM self-test before a CUDA run (`h3core.generate.fp4gate`): which runs need it, which GPUs
and shapes it checks, how the verdict reaches each rank, and what it did not cover. The GPU and the
child process are stood in for (tests/gpu runs the real self-test)."""

from __future__ import annotations

import threading

import pytest
import torch

from h3core.generate import fp4gate
from h3core.generate.request import GenerateRequest, resolve
from h3core.nvfp4 import selftest
from h3core.nvfp4.matmul import PATH_CUDA_FP4
from h3core.nvfp4.selftest import FP4SelfTest, GemmCheck


def _record(device: str, shapes) -> FP4SelfTest:
    checks = [GemmCheck(m=m, n=n, k=k, verdict="ok", detail="") for m, n, k in shapes]
    return FP4SelfTest(device=device, accepted=True, path=PATH_CUDA_FP4, reason="passed", bound="", checks=checks)


@pytest.fixture
def blackwell(monkeypatch):
    """torch.cuda as 4 sm_120 GPUs, and the child process replaced by a record of what it was asked."""
    calls: list[tuple[str, tuple]] = []
    lock = threading.Lock()

    def child(shapes, device):
        with lock:
            calls.append((device, tuple(shapes)))
        return _record(device, shapes)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (12, 0))
    monkeypatch.setattr(selftest, "run_fp4_selftest", child)
    monkeypatch.setattr(fp4gate, "_tested", {})
    return calls


def _cuda(run):
    return run.model_copy(update={"request": run.request.model_copy(update={"device": "cuda"})})


@pytest.fixture(scope="module")
def tiny():
    return resolve(GenerateRequest(preset="tiny", steps=2))


def test_a_cpu_run_needs_no_self_test(tiny):
    assert fp4gate.with_fp4_selftest(tiny) is tiny and tiny.fp4_selftest is None


def test_every_gpu_of_the_run_is_tested_once_at_the_ranks_shapes(tiny, blackwell, monkeypatch):
    monkeypatch.setattr(fp4gate.settings, "ranks_on_this_machine", lambda world: 4)
    shapes = [[128, 256, 64], [32, 128, 64], [128, 256, 64]]
    run = fp4gate.with_fp4_selftest(_cuda(tiny), shapes)
    assert sorted(run.fp4_selftest) == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    assert sorted(d for d, _ in blackwell) == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    assert {s for _, s in blackwell} == {((32, 128, 64), (128, 256, 64))}  # sorted, unique
    again = fp4gate.with_fp4_selftest(_cuda(tiny), shapes)  # a parity reference, the next batch round
    assert len(blackwell) == 4 and again.fp4_selftest == run.fp4_selftest
    assert fp4gate.untested_shapes(run, [[128, 256, 64], [7, 128, 64]]) == [[7, 128, 64]]


def test_without_a_dry_run_the_default_shapes_are_tested(tiny, blackwell, monkeypatch):
    monkeypatch.setattr(fp4gate.settings, "ranks_on_this_machine", lambda world: 1)
    fp4gate.with_fp4_selftest(_cuda(tiny), None)
    assert blackwell == [("cuda:0", selftest.DEFAULT_SHAPES)]


def test_hopper_and_checkpoints_without_nvfp4_linears_need_none(tiny, blackwell, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert fp4gate.with_fp4_selftest(_cuda(tiny)).fp4_selftest is None
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (12, 0))
    dense = tiny.model_copy(update={"plan": tiny.plan.model_copy(update={"decoded": tiny.plan.decoded.model_copy(update={"count": 0})})})
    assert fp4gate.with_fp4_selftest(_cuda(dense)).fp4_selftest is None
    assert blackwell == []


def test_a_rank_takes_its_own_gpus_verdict(tiny, blackwell):
    refused = _record("cuda:1", []).model_copy(update={"accepted": False, "reason": "zeros at (M, N, K) = (300, 2048, 5376)"})
    run = tiny.model_copy(update={"fp4_selftest": {"cuda:0": _record("cuda:0", []), "cuda:1": refused}})
    assert fp4gate.rank_kernels(run, torch.device("cuda", 1)).fp4_gemm_problem() == refused.reason  # the rank takes the dequant path, saying why
    assert fp4gate.rank_kernels(run, torch.device("cuda", 0)).fp4_gemm_problem() is None
    assert blackwell == []  # the launcher's records decided: no self-test ran on the rank


def test_the_self_test_is_not_part_of_the_request(tiny):
    from h3core.generate.report import request_fingerprint

    tested = tiny.model_copy(update={"fp4_selftest": {"cuda:0": _record("cuda:0", [(1, 2, 3)])}})
    assert request_fingerprint(tested) == request_fingerprint(tiny)  # torchrun's ranks each test their own GPU
