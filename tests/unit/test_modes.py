"""A mode is a name (`Mode`, an Enum) and plain objects: its torch-free planning object in `MODES`
(a `ParallelMode`) and its apply function in `APPLY`. A planning object put in `MODES` decides what
`h3 plan`, the memory check and the parity bound say, with no other module edited; every name has
both; nothing outside the modes branches on a mode's name; and the planning side imports no torch."""

from __future__ import annotations

import ast
import math
import subprocess
import sys
from pathlib import Path
from types import MappingProxyType

import torch

from commands import one_line, run_main
from h3core.generate.memory import generate_need
from h3core.generate.parity import AMPLIFICATION, SAFETY, tolerance
from h3core.model.config import preset
from h3core.parallel import modes
from h3core.parallel.modes import MODES, BlockShape, Mode, ParallelMode
from h3core.parallel.modes.applying import APPLY
from h3core.parallel.plan import ParallelPlan

ROOT = Path(__file__).resolve().parents[2] / "h3core"


class RingStub:
    """A stand-in for ring attention's planning: weights replicated, its own activation memory, rounding and table."""

    summary = "test stub"

    def shards(self, config, heads):
        return [None] * len(heads)

    def weights_per_rank(self, specs, shards, config):
        return [(sum(s.nbytes for s in specs), 0)] * len(shards)

    def activation_elements(self, config, shape: BlockShape):
        return 1234 * shape.tokens

    def rounding_ulps(self, itemsize):
        return 3.0

    def plan_tables(self, shards):
        return [("ring steps", ["rank", "passes"], [[str(rank), str(len(shards) - 1)] for rank in range(len(shards))])]

    def left_out_at_load(self, num_blocks):
        return ()


def test_the_planning_object_decides_plan_memory_and_parity(capsys, monkeypatch):
    monkeypatch.setattr(modes, "MODES", MappingProxyType({**MODES, Mode.ULYSSES: RingStub()}))
    code, out, err = run_main(capsys, "plan", "4", "--mode", "ulysses", "--preset", "tiny", "--json")
    assert code == 0, err
    plan = ParallelPlan.model_validate_json(out)
    assert plan.mode == "ulysses" and plan.heads == [2, 2, 2, 2] and plan.weights.per_rank[0] == plan.weights.checkpoint_bytes
    code, out, err = run_main(capsys, "plan", "4", "--mode", "ulysses", "--preset", "tiny")
    assert code == 0 and "ring steps" in out and "passes" in out
    cfg = preset("tiny")
    need = generate_need(cfg, plan, 1000, 2, "cpu", torch.float32, "sdpa", spawned=False)
    assert need.on_device["activations"] == 1234 * plan.num_tokens * 4  # the object's own formula, in fp32 bytes
    assert tolerance(Mode.ULYSSES, torch.float32) == SAFETY * AMPLIFICATION * 3.0 * torch.finfo(torch.float32).eps


def test_every_mode_has_its_planning_object_and_its_apply_function():
    assert list(MODES) == list(APPLY) == list(Mode) == [Mode.ULYSSES, Mode.TENSOR]
    assert all(isinstance(planning, ParallelMode) for planning in MODES.values())
    assert not isinstance(object(), ParallelMode)  # an object without the methods is no mode


def test_a_mode_is_its_plain_name_in_json_and_reports():
    plan = ParallelPlan.build(preset("tiny"), 2, Mode.TENSOR, preset("tiny").segments(256, 128, 22, 4))
    assert plan.model_dump(mode="json")["mode"] == "tensor" and '"mode":"tensor"' in plan.model_dump_json()
    assert ParallelPlan.model_validate_json(plan.model_dump_json()).mode is Mode.TENSOR
    assert Mode("tensor") is Mode.TENSOR and str(Mode.TENSOR) == f"{Mode.TENSOR}" == "tensor"


def test_planning_imports_no_torch():
    code = ("import sys\nfrom h3core.model.config import preset\nfrom h3core.parallel import partition\n"
            "from h3core.parallel.modes import MODES, BlockShape, Mode\nimport h3core.parallel.plan\n"
            "cfg = preset('narrow')\nheads = partition.head_spans(cfg.num_heads, 6)\n"
            "for planning in MODES.values():\n    shards = planning.shards(cfg, heads)\n    planning.plan_tables(shards)\n"
            "    planning.activation_elements(cfg, BlockShape(1000, 170, 10, 6))\n    planning.rounding_ulps(2)\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_the_modes_need_no_type_ignore():
    assert [p.name for p in (ROOT / "parallel" / "modes").glob("*.py") if "type: ignore" in p.read_text()] == []


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
