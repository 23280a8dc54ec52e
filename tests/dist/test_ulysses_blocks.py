"""Ulysses attention's own path (RoPE written into the send blocks) vs finishing q|k|v first, on spawned ranks."""

import pytest
import torch

from h3core.model.attention import AttentionKernel
from h3core.model.config import preset
from h3core.model.sequence import SegmentKind, pack_segments
from h3core.parallel.modes import Mode
from h3core.parallel.modes.ulysses import ProjectedQKV, UlyssesProcessor
from h3core.parallel.plan import ParallelPlan
from h3core.parallel.runtime import ParallelRuntime


def _both_paths(ctx, size, num_tokens, num_heads, head_dim):
    sub = ctx.first_ranks(size)
    if sub is None:
        return None
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(num_tokens, num_heads, head_dim, generator=g) for _ in range(3))  # [S, H, Dh]
    angles = torch.rand(num_tokens, head_dim // 2, generator=g) * 30
    config = preset("narrow").model_copy(update={"num_heads": num_heads, "head_dim": head_dim})
    plan = ParallelPlan.build(config, size, Mode.ULYSSES, pack_segments([(SegmentKind.TEXT, num_tokens)]))
    tokens = plan.sequences[0].tokens
    rows = slice(tokens[sub.rank].start, tokens[sub.rank].stop)
    mine = ProjectedQKV(q[rows], k[rows], v[rows], angles[rows].cos(), angles[rows].sin())
    runtime = ParallelRuntime(plan, sub.rank, sub.group)
    processor = UlyssesProcessor(AttentionKernel("math"), runtime)
    with torch.inference_mode():
        fused = processor.attend_projected(mine, tokens)  # [S_loc, H, Dh]
        finished_first = processor.attend(*mine.split(), tokens)
    one_rank = AttentionKernel("math")(*ProjectedQKV(q, k, v, angles.cos(), angles.sin()).split())[rows]
    return {"fused": fused, "finished_first": finished_first, "one_rank": one_rank}


@pytest.mark.parametrize("size", [2, 6])
def test_rope_into_send_blocks_is_bitwise_the_finished_path(world8, size):
    """56 heads over 6 ranks are ragged (10,10,9,9,9,9): two runs of send blocks."""
    for result in world8.run(_both_paths, size, 37, 56, 16)[:size]:
        assert torch.equal(result["fused"], result["finished_first"])
        torch.testing.assert_close(result["fused"], result["one_rank"], rtol=1e-5, atol=1e-6)
