"""RoPE and v's GEMM written into another layout (Ulysses' send blocks) are bit for bit RoPE and
the fused q|k|v GEMM into new tensors."""

import math

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from h3core.model import rope as dit
from h3core.model.rope import apply_rope, rope_chunk_rows
from h3core.nvfp4.linear import NVFP4Linear
from h3core.parallel.collectives import send_blocks
from h3core.parallel.modes.ulysses import LinearHeads, ProjectedQKV
from h3core.parallel.partition import head_spans


def _reference_rope(x, cos, sin):
    """The reference's form (diffusers `_apply_rotary_emb`), in x's dtype with cos and sin cast to it:
    `x * [cos, cos] + [-x2, x1] * [sin, sin]` on the first 2 * cos.shape[-1] channels, the rest as is."""
    half = cos.shape[-1]
    c, s = cos.to(x.dtype)[:, None, :], sin.to(x.dtype)[:, None, :]
    x1, x2, rest = x[..., :half], x[..., half : 2 * half], x[..., 2 * half :]
    rotary = torch.cat([x1, x2], -1) * torch.cat([c, c], -1) + torch.cat([-x2, x1], -1) * torch.cat([s, s], -1)
    return torch.cat([rotary, rest], dim=-1)


def _projected(tokens, heads, head_dim, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(tokens, heads, head_dim, generator=g).to(dtype) for _ in range(3))
    angles = torch.rand(tokens, 3 * head_dim // 8, generator=g) * 40  # 3/4 of the channels rotate, as H3's 96 of 128
    return ProjectedQKV(q, k, v, angles.cos(), angles.sin())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_rope_matches_the_textbook_form_and_writes_any_layout(dtype):
    p = _projected(37, 12, 16, dtype)
    expected = _reference_rope(p.q, p.cos, p.sin)
    assert torch.equal(apply_rope(p.q, p.cos, p.sin), expected)
    # a strided destination: heads grouped (3 peers x 4 heads) inside a bigger buffer
    out = torch.full((37, 2, 3, 4, 16), float("nan"), dtype=dtype)[:, 1]
    apply_rope(p.q.unflatten(1, (3, 4)), p.cos, p.sin, out=out)
    assert torch.equal(out.flatten(1, 2), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_in_row_chunks_gives_the_bits_of_one_pass(monkeypatch, dtype):
    """On the CPU RoPE runs over chunks of rows (cache-sized); every row, the ragged last chunk
    included, is written, with the bits of the textbook form, into new tensors and strided blocks."""
    p = _projected(37, 12, 16, dtype)
    expected = _reference_rope(p.q, p.cos, p.sin)
    monkeypatch.setattr(dit, "ROPE_CHUNK_BYTES", 5 * 12 * 16 * p.q.element_size())  # 5 rows per chunk: 7 + a last of 2
    assert rope_chunk_rows(p.q) == 5
    assert torch.equal(apply_rope(p.q, p.cos, p.sin), expected)
    out = torch.full((37, 2, 3, 4, 16), float("nan"), dtype=dtype)[:, 1]
    apply_rope(p.q.unflatten(1, (3, 4)), p.cos, p.sin, out=out)
    assert torch.equal(out.flatten(1, 2), expected)


def test_rope_chunks_are_sized_by_bytes_on_the_cpu_and_whole_elsewhere():
    # H3's 56 x 128 heads: 28 KiB of float32 per row -> 36 rows per 1 MiB chunk; a GPU takes every row at once
    assert rope_chunk_rows(torch.empty(4096, 56, 128)) == dit.ROPE_CHUNK_BYTES // (56 * 128 * 4) == 36
    assert rope_chunk_rows(torch.empty(4096, 56, 128, dtype=torch.bfloat16)) == 73  # computed in bf16: 14 KiB rows
    assert rope_chunk_rows(torch.empty(146, 56, 128)) == 146  # 4 MiB or less: in cache anyway, one pass
    assert rope_chunk_rows(torch.empty(147, 56, 128)) == 36
    assert rope_chunk_rows(torch.empty(4096, 56, 128, device="meta")) == 4096


@pytest.mark.parametrize("ranks", [2, 3, 5])
def test_written_send_blocks_equal_the_pack_of_finished_qkv(ranks):
    """13 heads are ragged over 2, 3 and 5 ranks: blocks hold [S_loc, 3, H_j, Dh] per peer, in rank order."""
    p = _projected(9, 13, 8, torch.float32, seed=ranks)
    blocks, expected = _written_and_packed(p, head_spans(13, ranks), head_dim=8)
    assert torch.equal(blocks.buffer, expected)
    assert sum(r.stop - r.start for r, _ in blocks.pieces) == 13 and len(blocks.pieces) <= 2


def _written_and_packed(p, heads, head_dim):
    """The send blocks `p.write` fills (NaN where nothing was written), and the pack of `p.split()`
    they must equal: per peer, its heads of [S_loc, 3, H, Dh], in rank order."""
    blocks = send_blocks(p.q.shape[0], (3,), head_dim, heads, p.q)
    blocks.buffer.fill_(float("nan"))
    for head_range, view in blocks.pieces:
        p.write(head_range, view)
    finished = torch.stack(p.split(), dim=1)  # [S_loc, 3, H, Dh]
    return blocks, torch.cat([finished[:, :, h.start : h.stop].reshape(-1) for h in heads])


def _lazy_projected(tokens, heads, head_dim, seed=0):
    """q, k finished by a fused QKV linear; v still lazy (`LinearHeads`), as the model's dequant path builds it."""
    g = torch.Generator().manual_seed(seed)
    width = heads * head_dim
    linear = NVFP4Linear.from_float(torch.randn(3 * width, width, generator=g), torch.randn(3 * width, generator=g))
    h = torch.randn(tokens, width, generator=g)
    fused = linear(h).unflatten(-1, (3, heads, head_dim))  # [S, 3, H, Dh]
    angles = torch.rand(tokens, 3 * head_dim // 8, generator=g) * 40  # 3/4 of the channels rotate, as H3's 96 of 128
    lazy = LinearHeads(linear, h, 2 * width, heads, head_dim)
    return ProjectedQKV(fused[:, 0], fused[:, 1], lazy, angles.cos(), angles.sin()), fused


@pytest.mark.parametrize("ranks", [2, 3, 5])
def test_v_gemm_written_into_send_blocks_equals_the_fused_projection(ranks):
    """v's GEMM per peer, into the blocks, is bitwise v of the fused q|k|v GEMM (13 ragged heads)."""
    p, fused = _lazy_projected(9, 13, 16, seed=ranks)
    assert torch.equal(p.split()[2], fused[:, 2])
    blocks, expected = _written_and_packed(p, head_spans(13, ranks), head_dim=16)
    assert torch.equal(blocks.buffer, expected)


def test_v_gemm_into_send_blocks_copies_nothing_of_v():
    """The GEMM writes v through the blocks' row stride: no copy of v's size runs (the profiler
    sees every aten op; only the weight decoding's small copies remain)."""
    p, _ = _lazy_projected(37, 13, 16)
    blocks = send_blocks(37, (3,), 16, head_spans(13, 3), p.q)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for head_range, view in blocks.pieces:
            p.v.into(head_range, view[:, 2])
    ops = [e for e in prof.events() if e.name in ("aten::copy_", "aten::mm")]
    assert sum(e.name == "aten::mm" for e in ops) == 3  # one GEMM per peer
    v_sizes = {37 * w * 16 for w in (4, 5)}  # a peer's block of v: 5 or 4 heads
    copied = [math.prod(e.input_shapes[0]) for e in ops if e.name == "aten::copy_"]
    assert not v_sizes & set(copied), copied
