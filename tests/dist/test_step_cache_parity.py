"""The step cache gives the one-rank result at every count, in both modes: the decision to skip is
taken once per step from the change summed over the sequence's ranks, so 2, 4 and 6 Gloo ranks
skip exactly the steps one rank skips, and their latents are within the derived bound of the
one-rank cached run (`h3core.generate.parity.tolerance`). Errors: `-s`."""

from __future__ import annotations

import pytest
import torch

from h3core.generate.parity import latent_parity, tolerance
from h3core.generate.pipeline import rank_generate
from h3core.generate.request import GenerateRequest, resolve
from h3core.parallel.modes import Mode
from h3core.verify.session import as_world_of_one

BASE = dict(preset="tiny", steps=10, cache="fbcache:0.4")


def _generate(ctx, count, run):
    sub = ctx.first_ranks(count) if count > 1 else (as_world_of_one(ctx) if ctx.rank == 0 else None)
    if sub is None:
        return None
    outcome = rank_generate(sub, run)
    return {"latents": outcome.latents if sub.rank == 0 else None, "cache": outcome.cache}


@pytest.fixture(scope="module")
def reference(world8):
    return world8.run(_generate, 1, resolve(GenerateRequest(**BASE)))[0]


@pytest.mark.parametrize("mode", list(Mode))
def test_every_count_skips_the_steps_one_rank_skips(world8, reference, mode):
    skipped = reference["cache"].sequences["prompt"].skipped
    assert 0 < len(skipped) < BASE["steps"] - 1  # the threshold skips some steps and computes others
    bound = tolerance(mode, torch.float32)
    for count in (2, 4, 6):
        results = world8.run(_generate, count, resolve(GenerateRequest(**BASE, mode=mode, world_size=count)))[:count]
        assert all(r["cache"].sequences["prompt"].skipped == skipped for r in results), (count, [r["cache"] for r in results])
        err = latent_parity(results[0]["latents"], reference["latents"], bound, f"{mode.value} x{count}")
        print(f"step cache {mode.value} x{count}: skipped {skipped}, relative {err.relative:.3g} (bound {bound:g})")
        assert err.passed, err
