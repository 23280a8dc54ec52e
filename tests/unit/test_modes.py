"""A mode is one object in one registry: a third mode registered from this test file reaches `h3 plan`,
the memory check and the parity bound with no other module edited; one that provides nothing fails
loudly, naming what it lacks; and nothing outside the modes branches on a mode's name."""

from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest
import torch

from commands import one_line, run_main
from h3core.generate.memory import generate_need
from h3core.generate.parity import AMPLIFICATION, SAFETY, tolerance
from h3core.model.config import preset
from h3core.parallel.modes import Mode, ModeIncomplete, ParallelMode, register, unregister
from h3core.parallel.plan import ParallelPlan

ROOT = Path(__file__).resolve().parents[2] / "h3core"


class RingStub(ParallelMode):
    """A stand-in for ring attention: weights replicated, its own activation memory, rounding and table."""

    name = "ring-stub"
    summary = "test stub"

    def shards(self, config, heads):
        return [None] * len(heads)

    def weights_per_rank(self, specs, ranks, config):
        return [(sum(s.nbytes for s in specs), 0)] * len(ranks)

    def activation_elements(self, config, plan, tokens):
        return 1234 * tokens

    def rounding_ulps(self, dtype):
        return 3.0

    def plan_tables(self, plan):
        return [("ring steps", ["rank", "passes"], [[str(r.rank), str(plan.world_size - 1)] for r in plan.ranks])]


class Bare(ParallelMode):
    name = "bare-stub"


@pytest.fixture
def stubs():
    register(RingStub())
    register(Bare())
    yield
    unregister("ring-stub")
    unregister("bare-stub")


def test_a_registered_mode_reaches_plan_memory_and_parity(stubs, capsys):
    assert "ring-stub" in list(Mode)
    code, out, err = run_main(capsys, "plan", "4", "--mode", "ring-stub", "--preset", "tiny", "--json")
    assert code == 0, err
    plan = ParallelPlan.model_validate_json(out)
    assert plan.mode == "ring-stub" and plan.heads == [2, 2, 2, 2] and plan.weights.per_rank[0] == plan.weights.checkpoint_bytes
    code, out, err = run_main(capsys, "plan", "4", "--mode", "ring-stub", "--preset", "tiny")
    assert code == 0 and "ring steps" in out and "passes" in out
    cfg = preset("tiny")
    need = generate_need(cfg, plan, 1000, 2, "cpu", torch.float32, "sdpa", spawned=False)
    assert need.on_device["activations"] == 1234 * plan.num_tokens * 4  # the mode's own formula, in fp32 bytes
    assert tolerance(Mode("ring-stub"), torch.float32) == SAFETY * AMPLIFICATION * 3.0 * torch.finfo(torch.float32).eps


def test_a_mode_that_provides_nothing_fails_loudly_naming_what_it_lacks(stubs, capsys):
    code, _, err = run_main(capsys, "plan", "2", "--mode", "bare-stub", "--preset", "tiny")
    assert code == 2 and "mode 'bare-stub' does not define what each rank holds of the block linears (ParallelMode.shards)" in one_line(err)
    with pytest.raises(ModeIncomplete, match=r"its rounding for the parity bound \(ParallelMode.rounding_ulps\)"):
        tolerance(Mode("bare-stub"), torch.float32)
    plan = ParallelPlan.build(preset("tiny"), 2, Mode.ULYSSES, preset("tiny").segments(256, 128, 22, 4)).model_copy(update={"mode": Mode("bare-stub")})
    with pytest.raises(ModeIncomplete, match=r"ParallelMode.activation_elements"):
        generate_need(preset("tiny"), plan, 1000, 2, "cpu", torch.float32, "sdpa", spawned=False)


def test_an_unknown_mode_is_one_line(capsys):
    code, _, err = run_main(capsys, "plan", "2", "--mode", "ring")
    assert code == 2 and "unknown mode 'ring'; choose one of: ulysses, tensor" in one_line(err)


def test_nothing_outside_the_modes_branches_on_a_mode():
    """`Mode.TENSOR` / `Mode.ULYSSES` and the names as strings appear only in the modes themselves and in
    `h3 verify`, whose checks are about one mode each; elsewhere only as the default of a request."""
    allowed = {"h3core/generate/request.py"}  # `mode: Mode = Mode.ULYSSES`, the default
    found = []
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT.parent).as_posix()
        if rel.startswith(("h3core/parallel/modes/", "h3core/verify/")) or rel in allowed:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in ("TENSOR", "ULYSSES") and getattr(node.value, "id", "") == "Mode":
                found.append(f"{rel}:{node.lineno}")
            if isinstance(node, ast.Compare) and any(isinstance(c, ast.Constant) and c.value in ("tensor", "ulysses") for c in node.comparators):
                found.append(f"{rel}:{node.lineno}")
    assert found == []
    assert math.isfinite(len(list(Mode)))
