"""Checks of pure data movement: the Ulysses all-to-all (`transport`) and the ragged row
collectives (`ragged`). Both are exact by contract, so both are held to bitwise equality.

The collectives are called through the `h3core.parallel.collectives` module (not imported by name), the
same functions the model's parallel wrappers call.
"""

from __future__ import annotations

import torch

from h3core.model.sequence import SegmentKind
from h3core.parallel import collectives
from h3core.parallel.partition import balanced_spans, head_spans, kind_spans, token_spans
from h3core.runtime.context import RankContext
from h3core.runtime.device import Stopwatch
from h3core.span import Span
from h3core.verify.compare import measure_all, seeded, spec_dtype
from h3core.verify.rows import Measure
from h3core.verify.spec import VerifySpec

TRANSPORT_VARIANTS = ("seq->head->seq",)
RAGGED_VARIANTS = ("gather_rows", "reduce_scatter_rows")


def measure_transport(ctx: RankContext, spec: VerifySpec) -> list[Measure]:
    """seq_to_head then head_to_seq on the fused q|k|v of the spec's heads and ragged tokens.

    Checked twice: after seq->head this rank must hold every token of exactly its heads, and the
    round trip must give back its own token rows, bit for bit.
    """
    cfg, rank = spec.config, ctx.rank
    tokens, heads = token_spans(spec.num_tokens, ctx.world_size), head_spans(cfg.num_heads, ctx.world_size)
    mine, my_heads = tokens[rank], heads[rank]
    with Stopwatch(ctx.device) as watch:
        full = seeded((spec.num_tokens, 3, cfg.num_heads, cfg.head_dim), spec.seed, spec_dtype(spec), ctx.device)  # [S, 3, H, Dh]
        local = full[mine.start : mine.stop]  # [S_loc, 3, H, Dh]
        by_head = collectives.seq_to_head(local, tokens, heads, ctx.group)  # [S, 3, H_loc, Dh]
        back = collectives.head_to_seq(by_head, tokens, heads, ctx.group)  # [S_loc, 3, H, Dh]
        result = measure_all(
            TRANSPORT_VARIANTS[0],
            [("seq->head", by_head, full[..., my_heads.start : my_heads.stop, :]), ("round trip", back, local)],
            tolerance=0.0,
        )
    return [result.model_copy(update={"seconds": watch.seconds})]


def row_cases(spec: VerifySpec, world_size: int) -> dict[str, list[Span]]:
    """Row splits to gather and reduce-scatter: most ranks owning one row, and the packed tokens."""
    return {
        f"{world_size + 1} rows": balanced_spans(world_size + 1, world_size),  # rank 0 owns 2, every other rank 1
        f"{spec.num_tokens} tokens": token_spans(spec.num_tokens, world_size),
    }


def measure_ragged(ctx: RankContext, spec: VerifySpec) -> list[Measure]:
    """gather_rows and reduce_scatter_rows on ragged splits vs single-process references."""
    return [_measure_gather(ctx, spec), _measure_reduce_scatter(ctx, spec)]


def _measure_gather(ctx: RankContext, spec: VerifySpec) -> Measure:
    cases = row_cases(spec, ctx.world_size)
    # The audio rows of the packed tokens: the ranks holding no audio contribute no rows.
    audio = kind_spans(spec.segments, token_spans(spec.num_tokens, ctx.world_size), SegmentKind.AUDIO)
    if audio[-1].stop:
        cases["audio rows"] = audio
    pairs = []
    with Stopwatch(ctx.device) as watch:
        for index, (case, spans) in enumerate(cases.items()):
            full = _rows(spec, spans[-1].stop, spec.seed + 10 + index, ctx.device)  # [n, D]
            mine = spans[ctx.rank]
            gathered = collectives.gather_rows(full[mine.start : mine.stop], spans, ctx.group)  # [n, D]
            pairs.append((case, gathered, full))
        result = measure_all(RAGGED_VARIANTS[0], pairs, tolerance=0.0)
    return result.model_copy(update={"seconds": watch.seconds})


def _measure_reduce_scatter(ctx: RankContext, spec: VerifySpec) -> Measure:
    pairs = []
    with Stopwatch(ctx.device) as watch:
        for index, (case, spans) in enumerate(row_cases(spec, ctx.world_size).items()):
            n = spans[-1].stop
            # Every rank's partial of every row; each rank can build all of them (same seeds).
            partials = [_rows(spec, n, spec.seed + 100 * (index + 1) + peer, ctx.device) for peer in range(ctx.world_size)]
            mine = spans[ctx.rank]
            reduced = collectives.reduce_scatter_rows(partials[ctx.rank], spans, ctx.group)  # [n_loc, D]
            pairs.append((case, reduced, rank_order_sum(partials)[mine.start : mine.stop]))
        result = measure_all(RAGGED_VARIANTS[1], pairs, tolerance=0.0)
    return result.model_copy(update={"seconds": watch.seconds})


def rank_order_sum(partials: list[torch.Tensor]) -> torch.Tensor:
    """The documented reduction: ((p_0 + p_1) + p_2) + ..., accumulated in float32, cast back once."""
    total = partials[0].float()
    for partial in partials[1:]:
        total = total + partial.float()
    return total.to(partials[0].dtype)


def _rows(spec: VerifySpec, n: int, seed: int, device: torch.device) -> torch.Tensor:
    return seeded((n, spec.config.hidden), seed, spec_dtype(spec), device)  # [n, D]
