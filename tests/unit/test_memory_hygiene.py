"""What a finished in-process run held is gone: `h3 matrix` and `--parity` run one-rank cells and
references in the launching process, on cuda:0 on a GPU machine, while later cells put rank 0 on
the same GPU. On the CPU: the model and its weights are garbage once `execute` returns, and the
device memory is released (on CUDA: cached blocks and cuBLAS workspaces, tests/gpu)."""

from __future__ import annotations

import weakref

import pytest

from h3core.generate.request import GenerateRequest, resolve
from h3core.generate.run import execute
from h3core.model.checkpoint import Checkpoint
from h3core.nvfp4.linear import NVFP4Linear
from h3core.parallel.modes import Mode
from h3core.runtime import device as dev


@pytest.mark.parametrize("mode", list(Mode))
def test_a_finished_one_rank_run_leaves_no_model_behind(monkeypatch, mode):
    held: list[weakref.ref] = []
    released: list[str] = []
    real_load, real_release = Checkpoint.load, dev.release_memory

    def load(self, **kwargs):
        model = real_load(self, **kwargs)
        held.append(weakref.ref(model))
        held.extend(weakref.ref(m.weight) for m in model.modules() if isinstance(m, NVFP4Linear) and m.weight.device.type != "meta")
        return model

    monkeypatch.setattr(Checkpoint, "load", load)
    monkeypatch.setattr(dev, "release_memory", lambda device: (released.append(device), real_release(device)))
    monkeypatch.setattr(NVFP4Linear, "emulate_fp4", True)  # with the fp4 operands and the scale agreement wired
    run = resolve(GenerateRequest(preset="tiny", steps=2, mode=mode))
    (outcome,) = execute(run)
    assert outcome.video is not None and held
    assert released == ["cpu"]
    assert [ref for ref in held if ref() is not None] == []
