"""Ulysses overlap's head groups (partition.head_groups): every head in exactly one group, each
group one non-empty part of every rank's heads, in order; at most as many groups as a rank has heads."""

import pytest

from h3core.parallel.partition import head_groups, head_spans


@pytest.mark.parametrize("heads, ranks, groups", [(56, 8, 2), (56, 6, 3), (14, 4, 3), (56, 1, 4), (8, 8, 2), (5, 4, 3)])
def test_groups_split_every_ranks_heads_and_cover_each_head_once(heads, ranks, groups):
    spans = head_spans(heads, ranks)
    found = head_groups(spans, groups)
    assert len(found) == max(1, min(groups, *(len(s) for s in spans)))
    for rank, own in enumerate(spans):
        parts = [group[rank] for group in found]
        assert all(len(p) > 0 for p in parts) and parts[0].start == own.start and parts[-1].stop == own.stop
        assert all(a.stop == b.start for a, b in zip(parts, parts[1:]))  # in order, no gap
    assert sorted(h for group in found for s in group for h in range(s.start, s.stop)) == list(range(heads))


def test_one_group_is_the_whole_split():
    spans = head_spans(56, 6)
    assert head_groups(spans, 1) == [spans]


def test_the_memory_check_counts_the_overlapped_return_buffer():
    """Overlapped, the returns' receive buffer [S_loc, H, Dh] is alive beside the send blocks: the
    formula's Ulysses attention working set grows by exactly that (tensor mode has no overlap)."""
    from h3core.model.config import preset
    from h3core.parallel.modes import MODES, BlockShape, Mode

    config = preset("h3")
    whole = BlockShape(tokens=17_608, local_tokens=2_201, local_heads=7, world_size=8)
    grown = MODES[Mode.ULYSSES].activation_elements(config, whole._replace(overlapped=True)) - MODES[Mode.ULYSSES].activation_elements(config, whole)
    assert grown == 2_201 * config.attention_width
