"""Many prompts, one load, on 2 ranks of the shared World: each prompt of a batch (the text encoder
loaded once on rank 0, the denoiser loaded once and held in each rank's process between World.run
calls) gives the same latents, bit for bit, as that prompt run alone by `rank_generate` (what
`h3 generate` runs on every rank), although the prompts differ in size and text length (so their
token spans differ) and one has guidance. Ulysses and tensor mode."""

from __future__ import annotations

import pytest
import torch

from h3core.generate.pipeline import rank_generate
from h3core.generate.request import GenerateRequest, resolve
from h3core.generate.resident import denoise_round, drop_held, encode_prompts_once
from h3core.parallel.modes import Mode

PROMPTS = [
    dict(prompt="a red fox running through fresh snow", seed=1),
    dict(prompt="rain", seed=2, width=128, height=64, guidance_scale=2.5, negative_prompt="a blurry, grainy picture"),
    dict(prompt="an owl at night, wind in the trees", seed=3, frames=5),
]


def _encoded(ctx, runs):
    """The batch's one text-encoder load: every run's hidden states on rank 0 (None elsewhere), and
    what the outcomes report of it."""
    encoded = encode_prompts_once(ctx, runs)
    return (encoded.texts, encoded.for_reports()) if encoded else (None, {})


def _batch_then_alone(ctx, runs):
    """World task on ranks 0-1: the batch's path for every run, then each run alone; rank 0 returns
    (latents, load seconds) per run for both, the other ranks None."""
    sub = ctx.first_ranks(2)
    if sub is None:
        return None
    try:
        texts, meta = _encoded(sub, runs)
        batched = [denoise_round(sub, [run], [texts[i]] if texts else None, [0.0], meta) for i, run in enumerate(runs)]
    finally:
        drop_held(sub)
    alone = [rank_generate(sub, run) for run in runs]
    if sub.rank != 0:
        return None
    return [(b.latents, b.timings["load"]) for b in batched], [a.latents for a in alone]


@pytest.mark.parametrize("mode", [Mode.ULYSSES, Mode.TENSOR])
def test_each_prompt_of_a_batch_equals_it_run_alone_bitwise(world8, mode):
    runs = [resolve(GenerateRequest(**p, mode=mode, world_size=2, steps=2, device="cpu")) for p in PROMPTS]
    assert len({r.plan.sequences[0].num_tokens for r in runs}) == 3  # three different token layouts
    batched, alone = world8.run(_batch_then_alone, runs)[0]
    assert batched[0][1] > 0 and [load for _, load in batched[1:]] == [0.0, 0.0]  # loaded once
    for (latents, _), reference in zip(batched, alone):
        for kind in ("video", "audio"):
            assert torch.equal(latents[kind], reference[kind]), kind


def _replicas_then_alone(ctx, runs, alone_runs):
    """World task on ranks 0-3 as 2 replica groups of 2: the batch's rounds (prompts 0 and 1 at once,
    then prompt 2 with group 1 idle), then each prompt alone on ranks 0-1. Every rank returns its
    outcomes of the rounds; rank 0 also the latents alone."""
    sub = ctx.first_ranks(4)
    if sub is None:
        return None
    try:
        texts, meta = _encoded(sub, runs)
        rounds = [
            denoise_round(sub, [runs[0], runs[1]], [texts[0], texts[1]] if texts else None, [0.0, 0.0], meta),
            denoise_round(sub, [runs[2], None], [texts[2], []] if texts else None, [0.0, 0.0], meta),
        ]
    finally:
        drop_held(sub)
    pair = ctx.first_ranks(2)
    alone = [rank_generate(pair, run) for run in alone_runs] if pair is not None else None
    return rounds, [a.latents for a in alone] if alone and pair.rank == 0 else None


def test_replica_groups_share_the_prompts_out_and_each_equals_it_alone_bitwise(world8):
    """--replicas 2 on 4 ranks: group 0 (ranks 0-1) and group 1 (ranks 2-3) each run their own prompt
    in the same World.run; each prompt's latents equal that prompt alone on 2 ranks, bit for bit;
    each group loads once; a round with fewer prompts than groups leaves group 1 idle."""
    runs = [resolve(GenerateRequest(**p, world_size=4, replicas=2, steps=2, device="cpu")) for p in PROMPTS]
    alone_runs = [resolve(GenerateRequest(**p, world_size=2, steps=2, device="cpu")) for p in PROMPTS]
    results = world8.run(_replicas_then_alone, runs, alone_runs)
    (first, second), alone = results[0]
    group1_first, group1_second = results[2][0]
    assert group1_second is None and results[3][0][1] is None  # group 1 idled in round 2
    leads = [first, group1_first, second]  # rank 0 ran prompts 0 and 2, rank 2 prompt 1
    assert [o.rank for o in leads] == [0, 2, 0]
    assert first.timings["load"] > 0 and group1_first.timings["load"] > 0 and second.timings["load"] == 0.0
    for lead, reference in zip(leads, alone):
        for kind in ("video", "audio"):
            assert torch.equal(lead.latents[kind], reference[kind]), kind
