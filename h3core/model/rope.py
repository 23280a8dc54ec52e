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

    `out[:R] = x[:R] * [cos, cos] + [-x2, x1] * [sin, sin]` (pairs `i, i + R/2`) in x's dtype with
    cos and sin cast to it: the reference's products and sum, so the same bits. With `out` (x's
    shape, any strides) the result is written there (what lets Ulysses attention skip its pack copy).
    Every element is computed alone, so row chunks (`rope_chunk_rows`) give the same bits as one pass.
    """
    step = x.shape[0] if torch.compiler.is_compiling() else rope_chunk_rows(x)  # compiled: one fused pass
    if step >= x.shape[0]:
        return _rope_rows(x, cos, sin, out)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device) if out is None else out
    for first in range(0, x.shape[0], step):
        rows = slice(first, first + step)
        _rope_rows(x[rows], cos[rows], sin[rows], out[rows])
    return out


def _rope_rows(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """`apply_rope` in one pass over x's rows (see there)."""
    half = cos.shape[-1]
    rotary = 2 * half
    broadcast = (cos.shape[0],) + (1,) * (x.dim() - 2) + (half,)  # [S, 1.., R/2]
    c, s = cos.to(x.dtype).reshape(broadcast), sin.to(x.dtype).reshape(broadcast)
    cos2, sin2 = torch.cat([c, c], dim=-1), torch.cat([-s, s], dim=-1)  # [S, 1.., R]
    xr = x[..., :rotary]
    rotated = torch.cat([xr[..., half:], xr[..., :half]], dim=-1).mul_(sin2)  # [x2, x1] * [-sin, sin] = [-x2, x1] * sin
    if out is None and torch.compiler.is_compiling():  # torch.compile traces no out= into a strided view: the same sums, as values
        return torch.cat([torch.add(torch.mul(xr, cos2), rotated), x[..., rotary:]], dim=-1)
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    torch.add(torch.mul(xr, cos2), rotated, out=out[..., :rotary])
    if rotary < x.shape[-1]:
        out[..., rotary:].copy_(x[..., rotary:])
    return out
