"""CommStats: counting, merging, serialising."""

import pickle

from h3core.parallel.collectives import CommStats


def test_record_and_totals():
    stats = CommStats()
    stats.record("seq_to_head", 100, 80)
    stats.record("seq_to_head", 100, 80)
    stats.record("gather_rows", 7, 9)
    assert stats.kinds["seq_to_head"].calls == 2
    assert stats.kinds["seq_to_head"].bytes_sent == 200
    assert stats.bytes_sent == 207 and stats.bytes_received == 169


def test_merge_sums_and_leaves_inputs_alone():
    a, b = CommStats(), CommStats()
    a.record("seq_to_head", 10, 10)
    b.record("seq_to_head", 5, 6)
    b.record("reduce_scatter_rows", 1, 2)
    merged = a.merged(b)
    assert merged.kinds["seq_to_head"].calls == 2 and merged.kinds["seq_to_head"].bytes_received == 16
    assert merged.kinds["reduce_scatter_rows"].bytes_sent == 1
    assert a.kinds["seq_to_head"].calls == 1 and "reduce_scatter_rows" not in a.kinds
    assert CommStats.total([a, b, b]).kinds["reduce_scatter_rows"].calls == 2


def test_serialises_to_plain_data_and_back():
    stats = CommStats()
    stats.record("head_to_seq", 3, 4)
    data = stats.model_dump()
    assert data == {"kinds": {"head_to_seq": {"calls": 1, "bytes_sent": 3, "bytes_received": 4}}}
    assert CommStats.model_validate(data) == stats
    assert pickle.loads(pickle.dumps(stats)) == stats
