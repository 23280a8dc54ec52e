"""Collectives on spawned Gloo ranks against single-process references (exact, bit for bit).

Shapes are ragged on purpose: 56 heads split 10,10,9,9,9,9 over 6 ranks; 13 heads are ragged at
every count; token counts divide by no rank count; some row splits give ranks a single row.
"""

import pytest
import torch

from h3core.parallel.collectives import (
    CommStats,
    broadcast_tensors,
    exchange_halves,
    gather_rows,
    head_to_seq,
    reduce_scatter_rows,
    repartition_rows,
    seq_to_head,
)
from h3core.parallel.partition import balanced_spans, head_spans, token_spans
from h3core.span import Span

COUNTS = [2, 4, 6, 8]
HEAD_DIM = 4
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _full(seed: int, shape: tuple, dtype: str) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(DTYPES[dtype])


# --- rank-side tasks (module level: they are sent to the workers) -------------------------------


def _ulysses_round_trip(ctx, size, num_tokens, num_heads, mid, dtype):
    sub = ctx.first_ranks(size)
    if sub is None:
        return None
    tokens, heads = token_spans(num_tokens, size), head_spans(num_heads, size)
    full = _full(7, (num_tokens, *mid, num_heads, HEAD_DIM), dtype)  # [S, *mid, H, Dh]
    local = full[tokens[sub.rank].start : tokens[sub.rank].stop]
    stats = CommStats()
    by_head = seq_to_head(local, tokens, heads, sub.group, stats)
    back = head_to_seq(by_head, tokens, heads, sub.group, stats)
    return {"by_head": by_head, "back": back, "stats": stats}


def _gather(ctx, size, num_rows, features, dtype):
    sub = ctx.first_ranks(size)
    if sub is None:
        return None
    rows = balanced_spans(num_rows, size)
    full = _full(11, (num_rows, *features), dtype)
    stats = CommStats()
    out = gather_rows(full[rows[sub.rank].start : rows[sub.rank].stop], rows, sub.group, stats)
    return {"out": out, "stats": stats}


def _reduce_scatter(ctx, size, num_rows, features, dtype):
    sub = ctx.first_ranks(size)
    if sub is None:
        return None
    rows = balanced_spans(num_rows, size)
    partial = _full(100 + sub.rank, (num_rows, *features), dtype)  # this rank's partial of every row
    stats = CommStats()
    return {"out": reduce_scatter_rows(partial, rows, sub.group, stats), "stats": stats}


def _shifted_spans(num_rows, size, shift):
    """A second ragged split of the same rows: boundaries moved by `shift` (empty spans allowed)."""
    cuts = [0] + [min(num_rows, max(0, s.stop + shift)) for s in balanced_spans(num_rows, size)[:-1]] + [num_rows]
    return [Span(a, b) for a, b in zip(cuts, cuts[1:])]


def _repartition(ctx, size, num_rows, shift):
    sub = ctx.first_ranks(size)
    if sub is None:
        return None
    source, target = balanced_spans(num_rows, size), _shifted_spans(num_rows, size, shift)
    full = _full(21, (num_rows, 3), "fp32")
    mine = source[sub.rank]
    return repartition_rows(full[mine.start : mine.stop], source, target, sub.group, CommStats())


def _exchange_halves(ctx, size):
    """Half b holds rows of two tensors (widths 3 and 2) in its own split; half 0's values are +0, half 1's +100."""
    sub = ctx.first_ranks(size)
    if sub is None:
        return None
    n, rows = size // 2, (3 * size + 1, size - 1)
    half, local = divmod(sub.rank, n)
    splits = [(balanced_spans(r, n), _shifted_spans(r, n, 1)) for r in rows]  # half 0 splits as [0], half 1 as [1]
    parts = []
    for index, (r, split) in enumerate(zip(rows, splits)):
        mine = split[half][local]
        full = _full(41 + index, (r, 3 - index), "fp32") + 100 * half
        parts.append((full[mine.start : mine.stop], split[half], split[1 - half]))
    stats = CommStats()
    return exchange_halves(parts, sub.group, stats), stats


def _broadcast(ctx, size):
    sub = ctx.first_ranks(size)
    if sub is None:
        return None
    tensors = [_full(31, (5, 4), "fp32"), _full(32, (0, 4), "fp32"), torch.arange(3)] if sub.rank == 0 else None
    return broadcast_tensors(tensors, src=0, group=sub.group, device=sub.device, stats=CommStats())


# --- Ulysses all-to-all ------------------------------------------------------------------------------


@pytest.mark.parametrize("size", COUNTS)
@pytest.mark.parametrize("num_tokens, num_heads", [(61, 56), (29, 13)])
@pytest.mark.parametrize("mid", [(), (3,)], ids=["q", "fused-qkv"])
def test_seq_to_head_matches_reference_and_round_trips_exactly(world8, size, num_tokens, num_heads, mid):
    results = world8.run(_ulysses_round_trip, size, num_tokens, num_heads, mid, "fp32")[:size]
    full = _full(7, (num_tokens, *mid, num_heads, HEAD_DIM), "fp32")
    tokens, heads = token_spans(num_tokens, size), head_spans(num_heads, size)
    for rank, result in enumerate(results):
        expected = full[..., heads[rank].start : heads[rank].stop, :]  # every token, this rank's heads
        assert result["by_head"].shape == expected.shape
        assert torch.equal(result["by_head"], expected)
        assert torch.equal(result["back"], full[tokens[rank].start : tokens[rank].stop])


@pytest.mark.parametrize("size", [6, 8])
def test_round_trip_is_exact_in_bf16(world8, size):
    results = world8.run(_ulysses_round_trip, size, 53, 56, (3,), "bf16")[:size]
    full = _full(7, (53, 3, 56, HEAD_DIM), "bf16")
    tokens = token_spans(53, size)
    for rank, result in enumerate(results):
        assert result["back"].dtype == torch.bfloat16
        assert torch.equal(result["back"], full[tokens[rank].start : tokens[rank].stop])


def test_ulysses_counts_the_bytes_it_moves(world8):
    size, num_tokens, num_heads, mid = 6, 61, 56, (3,)
    results = world8.run(_ulysses_round_trip, size, num_tokens, num_heads, mid, "fp32")[:size]
    tokens, heads = token_spans(num_tokens, size), head_spans(num_heads, size)
    row = 3 * HEAD_DIM * 4  # fused q|k|v, fp32
    for rank, result in enumerate(results):
        stats = result["stats"]
        mine, others = len(heads[rank]), num_heads - len(heads[rank])
        s2h = stats.kinds["seq_to_head"]
        assert s2h.calls == 1
        assert s2h.bytes_sent == len(tokens[rank]) * others * row
        assert s2h.bytes_received == (num_tokens - len(tokens[rank])) * mine * row
        h2s = stats.kinds["head_to_seq"]
        assert (h2s.bytes_sent, h2s.bytes_received) == (s2h.bytes_received, s2h.bytes_sent)


# --- ragged rows ------------------------------------------------------------------------------------


def _row_cases(size):
    # one row each; rank 0 owns two, the rest one; a ragged larger split
    return [(size, (5,)), (size + 1, (2, 3)), (3 * size + 2, (5,))]


@pytest.mark.parametrize("size", COUNTS)
def test_gather_rows_matches_reference(world8, size):
    for num_rows, features in _row_cases(size):
        results = world8.run(_gather, size, num_rows, features, "fp32")[:size]
        full = _full(11, (num_rows, *features), "fp32")
        longest = max(len(s) for s in balanced_spans(num_rows, size))
        for result in results:
            assert torch.equal(result["out"], full)  # padding removed
            counts = result["stats"].kinds["gather_rows"]
            assert counts.bytes_sent == (size - 1) * longest * full[0].numel() * 4


@pytest.mark.parametrize("size", COUNTS)
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_reduce_scatter_rows_sums_in_rank_order(world8, size, dtype):
    for num_rows, features in _row_cases(size):
        results = world8.run(_reduce_scatter, size, num_rows, features, dtype)[:size]
        partials = [_full(100 + r, (num_rows, *features), dtype) for r in range(size)]
        total = partials[0].float()
        for partial in partials[1:]:
            total = total + partial.float()  # ((p0 + p1) + p2) + ..., float32, cast once
        rows = balanced_spans(num_rows, size)
        for rank, result in enumerate(results):
            expected = total[rows[rank].start : rows[rank].stop].to(DTYPES[dtype])
            assert result["out"].dtype == DTYPES[dtype]
            assert torch.equal(result["out"], expected)
            counts = result["stats"].kinds["reduce_scatter_rows"]
            itemsize = partials[0].element_size()
            assert counts.bytes_sent == (num_rows - len(rows[rank])) * partials[0][0].numel() * itemsize


# --- re-splitting and broadcasting --------------------------------------------------------------------


@pytest.mark.parametrize("size", COUNTS)
@pytest.mark.parametrize("shift", [-3, 2, 40])
def test_repartition_rows_moves_rows_to_the_other_split(world8, size, shift):
    num_rows = 3 * size + 1
    results = world8.run(_repartition, size, num_rows, shift)[:size]
    full = _full(21, (num_rows, 3), "fp32")
    for rank, span in enumerate(_shifted_spans(num_rows, size, shift)):
        assert torch.equal(results[rank], full[span.start : span.stop])  # some targets are empty


@pytest.mark.parametrize("size", [2, 6])
def test_exchange_halves_gives_every_rank_the_other_halfs_rows_in_one_call(world8, size):
    n, rows = size // 2, (3 * size + 1, size - 1)
    for rank, (got, stats) in enumerate(world8.run(_exchange_halves, size)[:size]):
        half, local = divmod(rank, n)
        for index, r in enumerate(rows):
            mine = (balanced_spans(r, n), _shifted_spans(r, n, 1))[half][local]
            other = _full(41 + index, (r, 3 - index), "fp32") + 100 * (1 - half)
            assert torch.equal(got[index], other[mine.start : mine.stop])  # some ranks hold no rows of a part
        assert stats.kinds["cfg_exchange"].calls == 1
        assert stats.kinds["cfg_exchange"].bytes_received == sum(len(s[half][local]) * (3 - i) * 4 for i, s in enumerate(
            (balanced_spans(r, n), _shifted_spans(r, n, 1)) for r in rows))


@pytest.mark.parametrize("size", [2, 8])
def test_broadcast_tensors_reaches_every_rank(world8, size):
    expected = [_full(31, (5, 4), "fp32"), _full(32, (0, 4), "fp32"), torch.arange(3)]
    for result in world8.run(_broadcast, size)[:size]:
        assert len(result) == 3 and all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(result, expected))
