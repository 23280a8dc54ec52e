"""Ulysses overlap (issue 34.4): the all-to-alls split by head groups and in flight while attention
runs give bitwise the output of the whole all-to-all, at 2 and 4 Gloo ranks; a group order the
ranks disagree on is caught."""

import pytest
import torch

from h3core.model.attention import AttentionKernel
from h3core.model.config import preset
from h3core.model.sequence import SegmentKind, pack_segments
from h3core.nvfp4.linear import NVFP4Linear
from h3core.parallel.collectives import CommStats, FlightLog
from h3core.parallel.modes import Mode
from h3core.parallel.modes.ulysses import LinearHeads, ProjectedQKV, UlyssesProcessor
from h3core.parallel.overlap import UlyssesOverlap
from h3core.parallel.plan import ParallelPlan
from h3core.parallel.runtime import ParallelRuntime

NUM_TOKENS, NUM_HEADS, HEAD_DIM = 37, 14, 16


def _runtime(sub, size: int, groups: int) -> ParallelRuntime:
    config = preset("narrow").model_copy(update={"num_heads": NUM_HEADS, "head_dim": HEAD_DIM})
    plan = ParallelPlan.build(config, size, Mode.ULYSSES, pack_segments([(SegmentKind.TEXT, NUM_TOKENS)]))
    plan = plan.model_copy(update={"overlap": UlyssesOverlap(groups=groups, reason="test")})
    return ParallelRuntime(plan, sub.rank, sub.group)


def _projected(rows: slice, nvfp4_v: bool) -> ProjectedQKV:
    """This rank's rows of seeded q, k (normalised, not rotated) and v: a tensor, or an NVFP4 GEMM
    still to run (`LinearHeads`, written per peer and per group into the send blocks)."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(NUM_TOKENS, NUM_HEADS, HEAD_DIM, generator=g) for _ in range(3))  # [S, H, Dh]
    angles = torch.rand(NUM_TOKENS, HEAD_DIM // 2, generator=g) * 30
    if not nvfp4_v:
        return ProjectedQKV(q[rows], k[rows], v[rows], angles[rows].cos(), angles[rows].sin())
    h = torch.randn(NUM_TOKENS, 32, generator=g)
    linear = NVFP4Linear.from_float(torch.randn(NUM_HEADS * HEAD_DIM, 32, generator=g), torch.randn(NUM_HEADS * HEAD_DIM, generator=g))
    return ProjectedQKV(q[rows], k[rows], LinearHeads(linear, h[rows], 0, NUM_HEADS, HEAD_DIM), angles[rows].cos(), angles[rows].sin())


def _overlapped_and_whole(ctx, size: int, groups: int, backend: str, nvfp4_v: bool, reverse_on_rank0: bool = False):
    sub = ctx.first_ranks(size)
    if sub is None:
        return None
    whole_rt, grouped_rt = _runtime(sub, size, 1), _runtime(sub, size, groups)
    if reverse_on_rank0 and sub.rank == 0:  # the mutation: rank 0 sends its groups in another order than its peers
        grouped_rt.head_groups = grouped_rt.head_groups[::-1]
    grouped_rt.stats.flights = FlightLog()
    tokens = whole_rt.token_spans(NUM_TOKENS)
    rows = slice(tokens[sub.rank].start, tokens[sub.rank].stop)
    with torch.inference_mode():
        whole = UlyssesProcessor(AttentionKernel(backend), whole_rt).attend_projected(_projected(rows, nvfp4_v), tokens)
        grouped = UlyssesProcessor(AttentionKernel(backend), grouped_rt).attend_projected(_projected(rows, nvfp4_v), tokens)
    return {
        "whole": whole, "grouped": grouped, "groups": len(grouped_rt.head_groups),
        "bytes": (whole_rt.stats.bytes_sent, grouped_rt.stats.bytes_sent),
        "calls": {k: c.calls for k, c in grouped_rt.stats.kinds.items()}, "flights": grouped_rt.stats.flights.take(),
    }


@pytest.mark.parametrize("size, groups, backend, nvfp4_v", [(2, 3, "sdpa", False), (4, 2, "math", True), (4, 3, "sdpa", True)])
def test_overlapped_attention_is_bitwise_the_whole_all_to_all(world8, size, groups, backend, nvfp4_v):
    """14 heads over 4 ranks are ragged (4, 4, 3, 3), and split into 3 groups unevenly (2+1+1 of 4)."""
    for result in world8.run(_overlapped_and_whole, size, groups, backend, nvfp4_v)[:size]:
        assert result["groups"] == groups
        assert torch.equal(result["grouped"], result["whole"])
        assert result["bytes"][0] == result["bytes"][1]  # the same bytes, in more messages
        assert result["calls"] == {"seq_to_head": groups, "head_to_seq": groups}
        assert set(result["flights"]) == {"seq_to_head", "head_to_seq"}  # every collective logged its time in flight


def test_a_group_order_the_ranks_disagree_on_is_caught(world8):
    """Mutation: rank 0 starts its head groups in reverse order; its peer reads rank 0's last head as
    the first group's (7 heads per rank in 7 groups of one: the sizes still agree), and the outputs differ."""
    results = world8.run(_overlapped_and_whole, 2, 7, "sdpa", False, True)[:2]
    assert not all(torch.equal(r["grouped"], r["whole"]) for r in results)
