"""RoPE written into another layout (Ulysses' send blocks) is bit for bit RoPE into a new tensor."""

import pytest
import torch

from h3core.model.dit import ProjectedQKV, apply_rope
from h3core.parallel.collectives import send_blocks
from h3core.parallel.partition import head_spans


def _reference_rope(x, cos, sin):
    """The textbook form: [x1 cos - x2 sin, x2 cos + x1 sin], in float32, cast back once."""
    half = x.shape[-1] // 2
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)


def _projected(tokens, heads, head_dim, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(tokens, heads, head_dim, generator=g).to(dtype) for _ in range(3))
    angles = torch.rand(tokens, head_dim // 2, generator=g) * 40
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


@pytest.mark.parametrize("ranks", [2, 3, 5])
def test_written_send_blocks_equal_the_pack_of_finished_qkv(ranks):
    """13 heads are ragged over 2, 3 and 5 ranks: blocks hold [S_loc, 3, H_j, Dh] per peer, in rank order."""
    p = _projected(9, 13, 8, torch.float32, seed=ranks)
    heads = head_spans(13, ranks)
    blocks = send_blocks(9, (3,), 8, heads, p.v)
    blocks.buffer.fill_(float("nan"))
    for head_range, view in blocks.pieces:
        p.write(head_range, view)
    finished = torch.stack(p.split(), dim=1)  # [S_loc, 3, H, Dh]
    expected = torch.cat([finished[:, :, h.start : h.stop].reshape(-1) for h in heads])
    assert torch.equal(blocks.buffer, expected)
    assert sum(r.stop - r.start for r, _ in blocks.pieces) == 13 and len(blocks.pieces) <= 2
