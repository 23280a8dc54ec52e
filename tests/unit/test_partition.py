import pytest
from hypothesis import given, strategies as st

from h3core.errors import NVFP4FormatError, PartitionError
from h3core.model.sequence import Segment, SegmentKind as K, pack_segments
from h3core.parallel import partition
from h3core.span import Span


@pytest.mark.parametrize(
    "world, expected",
    [(1, [56]), (2, [28, 28]), (4, [14] * 4), (6, [10, 10, 9, 9, 9, 9]), (8, [7] * 8), (3, [19, 19, 18]), (7, [8] * 7)],
)
def test_head_ownership_matches_the_seed_table(world, expected):
    spans = partition.head_spans(56, world)
    assert [len(s) for s in spans] == expected
    assert spans[0].start == 0 and spans[-1].stop == 56


def test_too_many_ranks_names_count_and_limit():
    with pytest.raises(PartitionError, match=r"56 attention heads over 57 ranks.*at most 56"):
        partition.head_spans(56, 57)
    with pytest.raises(PartitionError, match="at least 1"):
        partition.balanced_sizes(4, 0)


def test_ragged_tokens_give_the_remainder_to_the_first_ranks():
    assert [s.as_list() for s in partition.token_spans(14855, 6)] == [
        [0, 2476], [2476, 4952], [4952, 7428], [7428, 9904], [9904, 12380], [12380, 14855]
    ]
    assert [len(s) for s in partition.token_spans(11, 4)] == [3, 3, 3, 2]
    assert [len(s) for s in partition.token_spans(8, 8)] == [1] * 8


@given(n=st.integers(1, 5000), world=st.integers(1, 64))
def test_spans_tile_the_whole_exactly(n, world):
    if n < world:
        with pytest.raises(PartitionError):
            partition.balanced_spans(n, world)
        return
    spans = partition.balanced_spans(n, world)
    assert len(spans) == world
    assert spans[0].start == 0 and spans[-1].stop == n
    assert all(a.stop == b.start for a, b in zip(spans, spans[1:]))
    sizes = [len(s) for s in spans]
    assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1
    assert sizes == sorted(sizes, reverse=True)


SEGS = pack_segments([(K.TEXT, 10), (K.VIDEO, 20), (K.AUDIO, 5)])


def test_pack_segments_is_back_to_back_and_drops_empty():
    assert SEGS == [Segment(K.TEXT, 0, 10), Segment(K.VIDEO, 10, 30), Segment(K.AUDIO, 30, 35)]
    assert pack_segments([(K.TEXT, 0), (K.VIDEO, 3)]) == [Segment(K.VIDEO, 0, 3)]


@pytest.mark.parametrize(
    "interval, expected",
    [
        # interval inside one segment
        (Span(12, 18), [Segment(K.VIDEO, 0, 6)]),
        # straddling text|video
        (Span(5, 15), [Segment(K.TEXT, 0, 5), Segment(K.VIDEO, 5, 10)]),
        # covering a whole segment and parts of both neighbours
        (Span(8, 32), [Segment(K.TEXT, 0, 2), Segment(K.VIDEO, 2, 22), Segment(K.AUDIO, 22, 24)]),
        # boundaries exactly on segment edges
        (Span(10, 30), [Segment(K.VIDEO, 0, 20)]),
        (Span(30, 35), [Segment(K.AUDIO, 0, 5)]),
        # one row at each edge
        (Span(9, 10), [Segment(K.TEXT, 0, 1)]),
        (Span(10, 11), [Segment(K.VIDEO, 0, 1)]),
        # outside every segment, and empty interval
        (Span(35, 40), []),
        (Span(12, 12), []),
        # the whole sequence
        (Span(0, 35), SEGS),
    ],
)
def test_clip_segments(interval, expected):
    assert partition.clip_segments(SEGS, interval) == expected


@given(n_text=st.integers(0, 30), n_video=st.integers(1, 60), n_audio=st.integers(0, 30), world=st.integers(1, 8))
def test_clipped_segments_reassemble_the_original(n_text, n_video, n_audio, world):
    segs = pack_segments([(K.TEXT, n_text), (K.VIDEO, n_video), (K.AUDIO, n_audio)])
    total = segs[-1].stop
    if total < world:
        return
    rows = []
    for span in partition.token_spans(total, world):
        for s in partition.clip_segments(segs, span):
            rows += [(s.kind, span.start + i) for i in range(s.start, s.stop)]
    assert rows == [(s.kind, i) for s in segs for i in range(s.start, s.stop)]


def test_nvfp4_column_slices_are_whole_blocks_and_ragged():
    # 74 blocks over 6 ranks -> 13, 13, 12, 12, 12, 12 blocks
    slices = partition.nvfp4_column_slices(1184, 6)
    assert [c.blocks for c in slices] == [13, 13, 12, 12, 12, 12]
    assert slices[1].elements == Span(208, 416)
    assert slices[1].packed_bytes == Span(104, 208)
    assert slices[1].scale_columns == Span(13, 26)
    assert slices[-1].elements.stop == 1184


@pytest.mark.parametrize("width", [0, 8, 100, 1190])
def test_nvfp4_width_not_a_multiple_of_16_is_rejected(width):
    with pytest.raises(NVFP4FormatError, match="multiple of 16"):
        partition.nvfp4_column_slices(width, 2)


def test_nvfp4_more_ranks_than_blocks_is_rejected():
    with pytest.raises(PartitionError, match="3 NVFP4 blocks"):
        partition.nvfp4_column_slices(48, 4)


def test_unaligned_column_slice_is_rejected():
    with pytest.raises(NVFP4FormatError, match="split a 16-element"):
        partition.column_slice(Span(8, 32))
    with pytest.raises(NVFP4FormatError):
        partition.head_column_slices(3, 24, 2)


@given(blocks=st.integers(1, 2000), world=st.integers(1, 16))
def test_column_slices_tile_in_all_three_units(blocks, world):
    if blocks < world:
        return
    width = blocks * 16
    slices = partition.nvfp4_column_slices(width, world)
    for unit, total in (("elements", width), ("packed_bytes", width // 2), ("scale_columns", blocks)):
        spans = [getattr(c, unit) for c in slices]
        assert spans[0].start == 0 and spans[-1].stop == total
        assert all(a.stop == b.start for a, b in zip(spans, spans[1:]))


def test_fused_rows_follow_head_ownership_in_each_third():
    q, k, v = partition.fused_qkv_rows(Span(10, 20), num_heads=56, head_dim=128)
    assert (q, k, v) == (Span(1280, 2560), Span(7168 + 1280, 7168 + 2560), Span(14336 + 1280, 14336 + 2560))
    cols = partition.nvfp4_column_slices(10752, 6)[5]
    gate, value = partition.gate_up_rows(cols, 10752)
    assert gate == cols.elements and value == cols.elements.shifted(10752)


def test_kind_rows_number_each_kind_from_its_own_start():
    assert partition.kind_rows(SEGS, Span(5, 15)) == {K.TEXT: Span(5, 10), K.VIDEO: Span(0, 5)}
    assert partition.kind_rows(SEGS, Span(28, 35)) == {K.VIDEO: Span(18, 20), K.AUDIO: Span(0, 5)}
    assert partition.kind_rows(SEGS, Span(12, 14)) == {K.VIDEO: Span(2, 4)}


@given(n_text=st.integers(0, 30), n_video=st.integers(1, 60), n_audio=st.integers(0, 30), world=st.integers(1, 8))
def test_kind_spans_tile_each_kind_and_agree_with_kind_rows(n_text, n_video, n_audio, world):
    segs = pack_segments([(K.TEXT, n_text), (K.VIDEO, n_video), (K.AUDIO, n_audio)])
    if segs[-1].stop < world:
        return
    tokens = partition.token_spans(segs[-1].stop, world)
    for seg in segs:
        spans = partition.kind_spans(segs, tokens, seg.kind)
        assert spans[0].start == 0 and spans[-1].stop == len(seg)
        assert all(a.stop == b.start for a, b in zip(spans, spans[1:]))
        for rank, span in enumerate(spans):
            assert partition.kind_rows(segs, tokens[rank]).get(seg.kind, Span(span.start, span.start)) == span or len(span) == 0


def test_span_overlap():
    assert Span(0, 10).overlap(Span(5, 20)) == 5
    assert Span(0, 10).overlap(Span(10, 20)) == 0
    assert Span(3, 4).overlap(Span(0, 100)) == 1
