"""Test tiers by folder: unit (CPU, fast), dist (spawned Gloo ranks), cli (the h3 command), gpu (CUDA)."""

from __future__ import annotations

import os
import pathlib

import pytest
import torch

# Triton builds its language for the interpreter or for a GPU once, when `triton.language` is first
# imported, and diffusers and comfy-kitchen import it. On a host without CUDA Triton can only
# interpret, so the whole session interprets: the fused-quantizer tests (tests/unit) then run on the
# CPU wherever they are collected. A CUDA host keeps the GPU build (tests/gpu runs its kernels).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

_TIERS = {"dist": pytest.mark.dist, "cli": pytest.mark.cli, "gpu": pytest.mark.gpu}


def pytest_collection_modifyitems(config, items):
    for item in items:
        tier = pathlib.Path(str(item.fspath)).parent.name
        if tier in _TIERS:
            item.add_marker(_TIERS[tier])


# --- RunPod: a fake v2 API on 127.0.0.1 (tests/runpod_fake.py) ----------------------------------


@pytest.fixture
def runpod(monkeypatch):
    """A running fake RunPod API; fails the test if it ever answered outside the OpenAPI contract."""
    from runpod_fake import TEST_KEY, FakeRunPod

    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")
    fake = FakeRunPod(TEST_KEY).start()
    try:
        yield fake
    finally:
        fake.stop()
    assert not fake.contract_violations, fake.contract_violations


@pytest.fixture
def runpod_env(runpod, monkeypatch):
    """RUNPOD_API_KEY and RUNPOD_API_BASE_URL pointing at the fake."""
    monkeypatch.setenv("RUNPOD_API_KEY", runpod.api_key)
    monkeypatch.setenv("RUNPOD_API_BASE_URL", runpod.base_url)
    return runpod
