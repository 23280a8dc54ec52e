"""World size 1 (group=None): every collective is the identity and costs nothing."""

import torch

from h3core.parallel.collectives import CommStats, gather_rows, head_to_seq, reduce_scatter_rows, seq_to_head
from h3core.parallel.partition import head_spans, token_spans


def test_one_rank_returns_the_input_itself():
    x = torch.randn(7, 3, 5, 4)  # [S, 3, H, Dh]
    stats = CommStats()
    tokens, heads = token_spans(7, 1), head_spans(5, 1)
    assert seq_to_head(x, tokens, heads, None, stats) is x
    assert head_to_seq(x, tokens, heads, None, stats) is x
    assert gather_rows(x, tokens, None, stats) is x
    assert reduce_scatter_rows(x, tokens, None, stats) is x
    assert stats.kinds == {}
