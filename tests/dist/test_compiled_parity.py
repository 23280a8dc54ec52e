"""`--compile` on 2 Gloo ranks in each mode: the compiled pieces sit between the collectives (every
graph break is a collective region the mode marked, nothing else), the run is the eager run of the
same count within the derived bound (`h3core.generate.parity.tolerance`), and the rank's record
counts the same GEMMs and attention calls. The tests run `aot_eager` (Dynamo's cut and AOT's
functional graph, no generated kernels: a few seconds; bitwise the eager run, so the cut itself
changes nothing); inductor's numerics are checked at one rank (tests/unit/test_compiled_blocks.py)
and, marked slow, here at 2 ranks too."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch._dynamo.utils import counters

from h3core.generate.parity import latent_parity, tolerance
from h3core.generate.pipeline import RankPipeline, rank_generate
from h3core.generate.request import GenerateRequest, resolve
from h3core.model.compiled import CompiledBlocks
from h3core.parallel.modes import Mode

COLLECTIVE_REGION = "torch.compiler.disable"
"""What Dynamo's reason names for a call it must not trace: a region a mode marked as a collective."""


def _generate(ctx, count, run, backend):
    sub = ctx.first_ranks(count)
    if sub is None:
        return None

    if backend is not None:
        torch._dynamo.reset()  # a fresh cut per run: a piece an earlier test compiled would count no break here

    def load(c, r, runtime):
        pipeline = RankPipeline.load(c, r, runtime)
        if backend is not None:
            pipeline.compiled = CompiledBlocks(pipeline.model, backend)
        return pipeline

    breaks_before, graphs = Counter(counters["graph_break"]), counters["stats"]["unique_graphs"]
    outcome = rank_generate(sub, run, load=load)
    breaks = Counter(counters["graph_break"]) - breaks_before
    return {"latents": outcome.latents if sub.rank == 0 else None, "breaks": dict(breaks), "compile": outcome.compile,
            "graphs": counters["stats"]["unique_graphs"] - graphs,
            "paths": outcome.nvfp4_paths, "kernels": outcome.attention_kernels}


STEPS = 2  # one forward: one shape, so each piece compiles once


def _request(mode, overlap="auto"):
    return resolve(GenerateRequest(preset="tiny", steps=STEPS, mode=mode, world_size=2, ulysses_overlap=overlap))


@pytest.fixture(scope="module")
def eager(world8):
    """Each mode's eager run at 2 ranks, once for the module."""
    return {mode: world8.run(_generate, 2, _request(mode), None)[:2] for mode in Mode}


def _compare(world8, eager, mode, backend, overlap="auto"):
    compiled = world8.run(_generate, 2, _request(mode, overlap), backend)[:2]
    bound = tolerance(mode, torch.float32)
    err = latent_parity(compiled[0]["latents"], eager[mode][0]["latents"], bound, f"compiled {mode.value} x2")
    print(f"--compile ({backend}) {mode.value} x2 vs eager x2: relative {err.relative:.3g} (bound {bound:g}); "
          f"graphs per rank {[c['graphs'] for c in compiled]}, breaks {[sum(c['breaks'].values()) for c in compiled]}")
    assert err.passed, err
    assert err.bitwise or backend != "aot_eager"  # the cut alone changes no bit: only inductor's kernels round otherwise
    for e, c in zip(eager[mode], compiled):
        assert e["compile"] is None and c["compile"] is not None and not c["compile"].fullgraph
        assert c["breaks"] and all(COLLECTIVE_REGION in reason for reason in c["breaks"]), c["breaks"]
        assert c["graphs"] >= 2  # compiled pieces on both sides of a collective
        assert c["paths"] == e["paths"]  # every GEMM counted once, compiled or not
        assert sum(c["kernels"].values()) == sum(e["kernels"].values())


@pytest.mark.parametrize("mode", list(Mode))
def test_compiled_pieces_between_collectives_match_eager(world8, eager, mode):
    _compare(world8, eager, mode, "aot_eager")


def test_overlapped_exchange_stays_outside_too(world8, eager):
    """`--ulysses-overlap on`: the head groups' async all-to-alls run inside the same eager region
    (bitwise the whole exchange, so bitwise the eager run here too)."""
    overlapped = {Mode.ULYSSES: world8.run(_generate, 2, _request(Mode.ULYSSES, "on"), None)[:2]}  # v's GEMM runs per group: more calls
    _compare(world8, overlapped, Mode.ULYSSES, "aot_eager", overlap="on")


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(Mode))
def test_inductor_at_two_ranks_matches_eager(world8, eager, mode):
    _compare(world8, eager, mode, "inductor")
