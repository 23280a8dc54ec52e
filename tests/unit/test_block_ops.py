"""A block forward issues no more aten ops than diffusers' on the same weights (issue 34.1), however
many segments the sequence has: the modulation and gating read every row's AdaLN table row with
one gather each, RoPE rotates without `cat`, and attention gets contiguous q, k, v.

Ops are counted below autograd by a `TorchDispatchMode`, every op ("all") and those that compute
or copy ("kernels": views such as `t`, `slice`, `unbind` left out; on a GPU each is a launch)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import h3_reference as ref
from h3core.model.checkpoint import load_transformer
from h3core.model.dit import AttentionProcessor
from h3core.model.inputs import Clocks, PackedSequence, rope_table
from h3core.model.sequence import AUDIO_TAG, TEXT_TAG, VIDEO_TAG, Segment, SegmentKind as K

_VIEW_LIKE = {"aten._unsafe_view"}  # a view the schema does not declare as one


class OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched inside it: `all`, and `kernels` (views left out)."""

    def __init__(self) -> None:
        super().__init__()
        self.all: Counter[str] = Counter()
        self.kernels: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        self.all[name] += 1
        returns = func._schema.returns
        aliased = any(r.alias_info is not None and not r.alias_info.is_write for r in returns)
        if not (func.is_view or aliased or name in _VIEW_LIKE):
            self.kernels[name] += 1
        return func(*args, **(kwargs or {}))


def _segments(cuts: int, rows: int) -> list[Segment]:
    """text | audio | video rows, the video split into `cuts` runs alternating two clocks."""
    text, audio = 5, 7
    video = rows - text - audio
    segs = [Segment(K.TEXT, 0, text, tag=TEXT_TAG, clock="video"), Segment(K.AUDIO, text, text + audio, tag=AUDIO_TAG, clock="audio")]
    bounds = torch.linspace(text + audio, rows, cuts + 1).long().tolist()
    for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        segs.append(Segment(K.VIDEO, a, b, tag=VIDEO_TAG, clock="video" if i % 2 == 0 else "cond"))
    return segs


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    reference = ref.random_model(num_attention_heads=6, attention_head_dim=16)
    path = ref.write_single(tmp_path_factory.mktemp("ops") / "m.safetensors", ref.original_state(reference))
    return reference, load_transformer(path)


def _h3_block(model, segs, rows: int):
    """h3's block 0 on `rows` random rows of `segs`: (counter, output, inputs for diffusers)."""
    g = torch.Generator().manual_seed(0)
    clocks = Clocks.of({"video": 0.3, "audio": 0.55, "cond": 1.0})
    positions = torch.randint(0, 20, (rows, 3), generator=g)
    seq = PackedSequence(segs, {}, rope_table(model.config, positions))
    x = torch.randn(rows, model.config.hidden, generator=g)
    cond = model.conditioning(clocks.values)
    table_rows = clocks.table_rows(segs)
    counter, x_in = OpCounter(), x.clone()  # the block adds to its input in place
    with torch.no_grad(), counter:
        out = model.blocks[0](x_in, cond, seq, table_rows)
    rotary = (torch.cat([seq.rope.cos] * 2, -1), torch.cat([seq.rope.sin] * 2, -1))
    return counter, out, (x[None], cond, table_rows, rotary)


def _diffusers_block(reference, inputs):
    counter = OpCounter()
    with torch.no_grad(), counter:
        out = reference.transformer_blocks[0](*inputs)
    return counter, out[0]


def test_a_block_issues_no_more_ops_than_diffusers_at_any_segment_count(models):
    reference, model = models
    counts = {}
    for cuts in (1, 12):
        h3, out, inputs = _h3_block(model, _segments(cuts, 96), 96)
        theirs, expected = _diffusers_block(reference, inputs)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)  # the same block (GEMMs split otherwise)
        counts[cuts] = (sum(h3.all.values()), sum(h3.kernels.values()), sum(theirs.all.values()), sum(theirs.kernels.values()))
        print(f"{len(inputs[2].unique())} table rows, {cuts + 2} segments: h3 {counts[cuts][:2]} vs diffusers {counts[cuts][2:]} (all, kernels)")
        assert h3.all.get("aten.cat", 0) == 0, h3.all
        assert counts[cuts][0] <= counts[cuts][2] and counts[cuts][1] <= counts[cuts][3], (dict(h3.all), dict(theirs.all))
    assert counts[1] == counts[12]  # one gather per table read, not one op per segment


def test_attention_gets_contiguous_inputs(models):
    """q, k and v reach the kernel as contiguous [S, H, Dh] (v leaves the fused q|k|v output by one copy)."""
    _, model = models
    seen = []

    class Spy(torch.nn.Module):
        def forward(self, q, k, v):
            seen.append([t.is_contiguous() for t in (q, k, v)])
            return kernel(q, k, v)

    processor = model.blocks[0].attn.processor
    kernel = processor.kernel
    spy = AttentionProcessor(Spy())
    model.blocks[0].attn.processor = spy
    try:
        _h3_block(model, _segments(3, 40), 40)
    finally:
        model.blocks[0].attn.processor = processor
    assert seen == [[True, True, True]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_rows", [None, 5])
def test_rope_in_place_has_the_bits_of_rope_into_a_new_tensor(dtype, chunk_rows, monkeypatch):
    """What the processor does to the normed q and k (`out=x`), in one pass and over row chunks."""
    from h3core.model import rope

    g = torch.Generator().manual_seed(4)
    x = torch.randn(37, 6, 16, generator=g).to(dtype)
    angles = torch.rand(37, 6, generator=g) * 40  # 12 of 16 channels rotate
    expected = rope.apply_rope(x, angles.cos(), angles.sin())
    if chunk_rows:
        monkeypatch.setattr(rope, "ROPE_CHUNK_BYTES", chunk_rows * 6 * 16 * x.element_size())
        assert rope.rope_chunk_rows(x) == chunk_rows
    y = x.clone()
    assert rope.apply_rope(y, angles.cos(), angles.sin(), out=y) is y
    assert torch.equal(y, expected) and torch.equal(y[..., 12:], x[..., 12:])
