"""Rotating q and k by a packed sequence's RoPE angles (`apply_rope`); the angles themselves are
`h3core.model.inputs.Rope` / `rope_table`.

Partial rotate-half RoPE, as the reference computes it: channels `[0, R)` of each head rotate in
pairs `i, i + R/2`, the rest pass through; on the CPU large inputs run over row chunks that stay in
cache (`ROPE_CHUNK_BYTES`), with the same bits as one pass.
"""

from __future__ import annotations

import math

import torch

ROPE_CHUNK_BYTES = 1 << 20
"""On the CPU, RoPE over more than 4 x this many bytes of input runs over row chunks of about this
size, so that its passes stay in cache instead of each streaming the whole activation through
memory (docs/performance.md). Smaller inputs, and every input on a GPU, run in one pass."""


def rope_chunk_rows(x: torch.Tensor) -> int:
    """Rows of x that `apply_rope` takes per pass: every row on a GPU or for a small x, else ~ROPE_CHUNK_BYTES."""
    rows = x.shape[0]
    row_bytes = x.element_size() * math.prod(x.shape[1:])
    if x.device.type != "cpu" or rows * row_bytes <= 4 * ROPE_CHUNK_BYTES:
        return max(rows, 1)
    return max(1, ROPE_CHUNK_BYTES // max(row_bytes, 1))


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Partial rotate-half RoPE. x: [S, *heads, Dh]; cos, sin: [S, R/2] -> rotates channels [0, R), keeps the rest.

    Pairs `i, i + R/2` of the first R channels: `out1 = x1 cos - x2 sin`, `out2 = x2 cos + x1 sin`
    in x's dtype with cos and sin cast to it, the reference's `x * [cos, cos] + [-x2, x1] * [sin, sin]`
    to the bit (`a + (-b)` is `a - b` exactly), with no `cat`. With `out` (x's shape, any strides;
    `out=x`: rotated in place) the result is written there (what lets Ulysses attention
    skip its pack copy). Every element is computed alone, so row chunks (`rope_chunk_rows`) give
    the same bits as one pass.
    """
    if torch.compiler.is_compiling():  # Dynamo traces no out= into a strided view: the same sums as values, one fused pass
        rotated = _rope_values(x, cos, sin)
        return rotated if out is None else out.copy_(rotated)
    in_place = out is x
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device) if out is None else out
    step = rope_chunk_rows(x)
    if step >= x.shape[0]:
        return _rope_rows(x, cos, sin, out, in_place)
    for first in range(0, x.shape[0], step):
        rows = slice(first, first + step)
        _rope_rows(x[rows], cos[rows], sin[rows], out[rows], in_place)
    return out


def _rope_rows(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor, in_place: bool) -> torch.Tensor:
    """`apply_rope` in one pass over x's rows into `out` (x itself where `in_place`; see there)."""
    half = cos.shape[-1]
    broadcast = (cos.shape[0],) + (1,) * (x.dim() - 2) + (half,)  # [S, 1.., R/2]
    c, s = cos.to(x.dtype).reshape(broadcast), sin.to(x.dtype).reshape(broadcast)
    x1, x2 = x[..., :half], x[..., half : 2 * half]
    out1, out2 = out[..., :half], out[..., half : 2 * half]
    x1_sin = x1 * s  # taken before out1 may overwrite x1
    torch.mul(x1, c, out=out1).sub_(x2 * s)
    torch.mul(x2, c, out=out2).add_(x1_sin)
    if 2 * half < x.shape[-1] and not in_place:
        out[..., 2 * half :].copy_(x[..., 2 * half :])
    return out


def _rope_values(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`apply_rope` as a new tensor from values alone (what a compiled block traces): the same products and sums."""
    half = cos.shape[-1]
    broadcast = (cos.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    c, s = cos.to(x.dtype).reshape(broadcast), sin.to(x.dtype).reshape(broadcast)
    x1, x2 = x[..., :half], x[..., half : 2 * half]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s, x[..., 2 * half :]], dim=-1)
