"""State travels with the call and belongs to its owner: one process runs a dry run on fake tensors,
one request, another, and the first request again (what a server does), and the first request's
bits, kernels, paths and bytes moved come back the same; nothing of one run leaks into the next (a
cache kept in a module would hand the dry run's data-less tensors to the next real run). And the
model file holds no parallelism: no rank, group, split or collective is named in it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from h3core.generate import dryrun
from h3core.generate.request import GenerateRequest, resolve
from h3core.generate.run import execute
from h3core.parallel.modes import Mode

ROOT = Path(__file__).resolve().parents[2] / "h3core"


def _outcome(run):
    (outcome,) = execute(run)
    return outcome


def _record(outcome) -> tuple:
    return (outcome.attention_kernels, outcome.nvfp4_paths, outcome.fp4_gemm_shapes, outcome.comm.model_dump(), outcome.used.model_dump())


def test_two_requests_and_a_dry_run_in_one_process_leave_nothing_behind(monkeypatch):
    monkeypatch.setenv("H3_EMULATE_FP4", "1")  # the fp4 path: codec tables, activation scales, the GEMM's operands
    first = resolve(GenerateRequest(preset="tiny", steps=3, mode=Mode.TENSOR, guidance_scale=3.0, negative_prompt="blurry"))
    second = resolve(GenerateRequest(preset="narrow", steps=2, mode=Mode.ULYSSES, prompt="two cats on a sofa", seed=7))
    dry = dryrun.dry_run(dryrun.preset_run(first.plan, "tiny", "cpu", steps=3), "cpu")  # fake tensors, same process, first
    before = _outcome(first)
    other = _outcome(second)
    after = _outcome(first)
    assert dry.ranks and other.video is not None
    for kind in ("video", "audio"):
        assert torch.equal(getattr(before, kind), getattr(after, kind))
    assert _record(before) == _record(after)
    assert set(other.used.tokens) == {"prompt"} and set(after.used.tokens) == {"prompt", "negative prompt"}


def test_the_model_file_names_no_parallelism():
    source = (ROOT / "model" / "dit.py").read_text()
    names = {node.id for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Name)}
    names |= {node.attr for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Attribute)}
    imported = {node.module for node in ast.walk(ast.parse(source)) if isinstance(node, ast.ImportFrom)}
    assert not any(m.startswith(("h3core.parallel", "torch.distributed")) for m in imported if m)
    assert not names & {"rank", "world_size", "group", "runtime", "TENSOR_PARALLEL", "Split", "send_blocks", "seq_to_head", "head_to_seq"}


@pytest.mark.parametrize("name", ["h3core"])
def test_no_patching_in_h3core(name):
    """The dry run and everything else use seams: nothing in h3core patches a name (`mock.patch`)."""
    found = [str(p.relative_to(ROOT.parent)) for p in (ROOT.parent / name).rglob("*.py") if "unittest" in p.read_text() or "mock." in p.read_text()]
    assert found == []


def test_the_gpus_memory_is_checked_before_the_weights_are_built(tmp_path, monkeypatch):
    """`h3 generate`'s GPU check (the dry run) sees the run before its weights exist: a refusal builds nothing."""
    from h3core.errors import ResourceLimit

    monkeypatch.setenv("H3_CACHE_DIR", str(tmp_path))
    seen = []

    def refuse(run):
        seen.append((run.synthetic, run.checkpoint.exists()))
        raise ResourceLimit("predicted peak above the GPU")

    with pytest.raises(ResourceLimit):
        resolve(GenerateRequest(preset="tiny", steps=2), check_gpus=refuse)
    assert seen == [(True, False)] and not list(tmp_path.rglob("*.safetensors"))
    run = resolve(GenerateRequest(preset="tiny", steps=2), check_gpus=lambda run: run)
    assert run.synthetic and run.checkpoint.is_file() and run.checkpoint.parent == tmp_path
