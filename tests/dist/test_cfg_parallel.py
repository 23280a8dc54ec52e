"""CFG parallel and the rank layout on the shared 8-rank World (sub-groups of its first ranks).

With guidance 3 and a negative prompt of another length than the prompt (so the two halves split
the latent rows differently and the exchange moves rows across split boundaries), every run's
final latents are compared with one rank, and with the same count without CFG parallel, within the
chosen mode's bound (`run_tolerance`); the errors are printed as a table. A mutation (each half
using its own velocity in place of the other branch's) exceeds the bound by orders of magnitude.
Replica groups: 2 replicas x 2 CFG halves x 2 ranks run the same request and both replicas' leads
hold the one-rank latents.

Every rank of the World runs each task and creates the layout's groups (`RankGroups.create` is
collective over the World), then the run's ranks take `first_ranks(count)`.
"""

from __future__ import annotations

import pytest
import torch

from h3core.generate import loop
from h3core.generate.parity import LatentParity, latent_parity, run_tolerance
from h3core.generate.pipeline import rank_generate
from h3core.generate.request import GenerateRequest, resolve
from h3core.parallel.layout import RankGroups
from h3core.parallel.modes import Mode
from h3core.verify.end_to_end import generate_as_one_rank
from h3core.verify.session import jobs_on_own_ranks

GUIDED = dict(preset="tiny", steps=2, guidance_scale=3.0, negative_prompt="blurry, low quality", device="cpu")
COUNTS = (2, 4, 6, 8)


def _generate(ctx, run, mutate: bool = False):
    """World task: the run on ranks 0..W-1 (layout groups created on every rank first); each run rank returns its outcome."""
    RankGroups.create(ctx, run.plan.layout)
    sub = ctx.first_ranks(run.request.world_size)
    if sub is None:
        return None
    if not mutate:
        return rank_generate(sub, run)
    real = loop.Denoiser.other_half
    loop.Denoiser.other_half = lambda self, v: v  # the bug: each half takes its own velocity for the other branch's
    try:
        return rank_generate(sub, run)
    finally:
        loop.Denoiser.other_half = real


def _resolve(mode: Mode, count: int, cfg: bool, **extra):
    return resolve(GenerateRequest(**GUIDED, mode=mode, world_size=count, cfg_parallel=cfg, **extra))


def _parity(result, reference, mode: Mode, paths, name: str) -> LatentParity:
    return latent_parity(result, reference, run_tolerance(mode, torch.float32, paths), name)


@pytest.fixture(scope="module")
def one_rank(world8):
    """The one-rank latents (a worker at 1 thread, as every rank of the World runs)."""
    (one,) = world8.run(jobs_on_own_ranks, [(generate_as_one_rank, (_resolve(Mode.ULYSSES, 1, False), False))])[:1]
    return one.latents


@pytest.fixture(scope="module")
def table(world8, one_rank):
    """count, mode -> (cfg outcome of rank 0, parity vs one rank, parity vs the same count without CFG parallel)."""
    rows = {}
    for count in COUNTS:
        for mode in Mode:
            cfg = world8.run(_generate, _resolve(mode, count, True))[0]
            plain = world8.run(_generate, _resolve(mode, count, False))[0]
            rows[count, mode] = (
                cfg,
                _parity(cfg.latents, one_rank, mode, cfg.nvfp4_paths, "1 rank"),
                _parity(cfg.latents, plain.latents, mode, cfg.nvfp4_paths, f"{count} ranks without CFG parallel"),
            )
    print("\nCFG parallel, tiny, guidance 3, 2 steps: relative latent error (bound)")
    for (count, mode), (_, vs_one, vs_plain) in rows.items():
        print(f"  {mode.value:8s} x{count} ({count // 2} per half): vs 1 rank {vs_one.relative:.3g}{' bitwise' if vs_one.bitwise else ''}, "
              f"vs x{count} without {vs_plain.relative:.3g}{' bitwise' if vs_plain.bitwise else ''} (bound {vs_one.tolerance:.3g})")
    return rows


@pytest.mark.parametrize("count", COUNTS)
@pytest.mark.parametrize("mode", list(Mode))
def test_cfg_parallel_matches_one_rank_and_the_same_count_without_it(table, count, mode):
    outcome, vs_one, vs_plain = table[count, mode]
    assert vs_one.tolerance == run_tolerance(mode, torch.float32, {}) and vs_one.passed and vs_plain.passed
    exchange = outcome.comm.kinds["cfg_exchange"]
    assert exchange.calls == GUIDED["steps"] - 1  # ONE exchange per step, every kind in it
    assert "repartition_rows" not in outcome.comm.kinds  # nothing re-splits rows within a half
    assert outcome.used.tokens.keys() == {"prompt"}  # rank 0 is in branch 0: it ran the prompt's sequence only


def test_wrong_branch_velocity_exceeds_the_bound_by_orders_of_magnitude(world8, one_rank):
    mutated = world8.run(_generate, _resolve(Mode.ULYSSES, 4, True), True)[0]
    parity = _parity(mutated.latents, one_rank, Mode.ULYSSES, mutated.nvfp4_paths, "1 rank")
    print(f"\nmutation (own velocity for the other branch's), ulysses x4: relative {parity.relative:.3g} vs bound {parity.tolerance:.3g}")
    assert parity.relative > 1000 * parity.tolerance


def test_two_replica_groups_each_give_the_one_rank_latents(world8, one_rank):
    run = _resolve(Mode.TENSOR, 8, True, replicas=2)  # 2 replicas x 2 CFG halves x 2 ranks
    outcomes = world8.run(_generate, run)
    assert [g.ranks for g in run.plan.layout.groups] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    leads = [o for o in outcomes if o.video is not None]
    assert [o.rank for o in leads] == [0, 4]  # local rank 0 of branch 0 in each replica holds its result
    for lead in leads:
        assert _parity(lead.latents, one_rank, Mode.TENSOR, lead.nvfp4_paths, "1 rank").passed
    assert torch.equal(leads[0].video, leads[1].video) and torch.equal(leads[0].audio, leads[1].audio)
    assert [o.used.tokens.keys() for o in outcomes] == [{"prompt"}] * 2 + [{"negative prompt"}] * 2 + [{"prompt"}] * 2 + [{"negative prompt"}] * 2
