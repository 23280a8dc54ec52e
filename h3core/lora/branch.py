"""The low-rank branch that sits beside one linear: `y += s * B(A x)`, the linear itself untouched.

A linear (`DenseLinear` or `NVFP4Linear`) may hold one `LowRankBranch` (its `lora` child): every
adapter and every pair that adapts that linear, stacked into one:

    low = (x @ down.T) * scale              # [M, R]: every pair's A stacked, its scale per row of A
    y[:, block.rows] += low[:, block.ranks] @ block.up.T      for each block

`down` is `[R, in]` (R = the ranks of all pairs summed), `scale` `[R]` float32 (the user's scale
times the pair's `alpha / rank`; a 16-bit `low` is multiplied in float32 and rounded once, as peft
multiplies by its Python-float `scaling`), and each block an output-row range of the linear with the columns of `low`
that feed it and its B `[len(rows), len(ranks)]`. A diffusers adapter on the fused qkv has three
blocks (q, k, v thirds, each its own A); a kohya one has one block over all rows (one A shared by
q, k and v); two adapters on one linear are two more ranges of `low`. Blocks of the same rows over
adjacent ranks are merged (one GEMM).

The matrices are held in the dtype the linear computes in (bf16 on a GPU for the NVFP4 linears,
float32 on the CPU; the float32 islands keep float32), as non-persistent buffers: `.to(device)`
moves them, `state_dict()` never sees them (a linear's checkpoint tensors are its own).

Tensor mode cuts a branch as it cuts its linear (`h3core.lora.tensor`): `rows_cut` keeps the output
rows a column-parallel shard holds (B's rows; A whole), `columns_cut` the input columns of a
row-parallel one (A's columns; B whole), so the partial `B(A_cols x_cols)` sums over the ranks in
the reduce-scatter the linear's partial joins.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn

from h3core.span import Span


@dataclass(frozen=True)
class UpBlock:
    """One block of a branch: output rows `rows` of the linear take `low[:, ranks] @ up.T`."""

    rows: Span
    ranks: Span
    up: torch.Tensor  # [len(rows), len(ranks)]


class LowRankBranch(nn.Module):
    """`y[:, rows] += ((x @ down.T) * scale)[:, ranks] @ up.T` per block (module docstring)."""

    def __init__(self, down: torch.Tensor, scale: torch.Tensor, blocks: Sequence[UpBlock]):
        super().__init__()
        assert down.dim() == 2 and scale.shape == (down.shape[0],), (down.shape, scale.shape)
        self.register_buffer("down", down, persistent=False)  # [R, in]
        self.register_buffer("scale", scale, persistent=False)  # [R]
        self.spans: list[tuple[Span, Span]] = []
        for i, block in enumerate(_merged(blocks)):
            assert block.up.shape == (len(block.rows), len(block.ranks)) and block.ranks.stop <= down.shape[0]
            self.register_buffer(f"up{i}", block.up, persistent=False)
            self.spans.append((block.rows, block.ranks))

    @property
    def blocks(self) -> list[UpBlock]:
        return [UpBlock(rows, ranks, getattr(self, f"up{i}")) for i, (rows, ranks) in enumerate(self.spans)]

    @property
    def in_features(self) -> int:
        return self.down.shape[1]

    @property
    def rank(self) -> int:
        return self.down.shape[0]

    @property
    def dtype(self) -> torch.dtype:
        return self.down.dtype

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """`(x @ down.T) * scale`: x [M, in] -> low [M, R] in the branch's dtype."""
        return (x.to(self.dtype) @ self.down.T).mul_(self.scale)

    def add_to(self, y: torch.Tensor, low: torch.Tensor, rows: slice | None = None) -> torch.Tensor:
        """y [M, out] (or [M, len(rows)] for output features `rows`) += every block's `low @ up.T`, in place."""
        first, stop = (0, None) if rows is None else (rows.start or 0, rows.stop)
        for block in self.blocks:
            a = max(block.rows.start, first)
            b = block.rows.stop if stop is None else min(block.rows.stop, stop)
            if a >= b:
                continue
            up = block.up[a - block.rows.start : b - block.rows.start]  # [b - a, ranks]
            y[:, a - first : b - first] += (low[:, block.ranks.start : block.ranks.stop] @ up.T).to(y.dtype)
        return y

    def rows_cut(self, spans: Sequence[Span]) -> "LowRankBranch":
        """The branch of a column-parallel shard holding output rows `spans` (concatenated in order):
        B's rows of those spans, A and the scales whole."""
        blocks, offset = [], 0
        for span in spans:
            for block in self.blocks:
                a, b = max(block.rows.start, span.start), min(block.rows.stop, span.stop)
                if a < b:
                    local = Span(offset + a - span.start, offset + b - span.start)
                    blocks.append(UpBlock(local, block.ranks, block.up[a - block.rows.start : b - block.rows.start].clone()))
            offset += len(span)
        return LowRankBranch(self.down, self.scale, blocks)

    def columns_cut(self, columns: Span) -> "LowRankBranch":
        """The branch of a row-parallel shard reading input columns `columns`: A's columns, B whole
        (its partial output sums over the ranks like the linear's)."""
        return LowRankBranch(self.down[:, columns.start : columns.stop].contiguous(), self.scale, self.blocks)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, rank={self.rank}, blocks={[(str(r), str(k)) for r, k in self.spans]}, dtype={self.dtype}"


def stack_pairs(pairs: Sequence[tuple[torch.Tensor, torch.Tensor, Span, float]], dtype: torch.dtype, device: torch.device | str) -> LowRankBranch:
    """One branch from pairs `(A [r, in], B [len(rows), r], rows, scale)` on one linear, in `dtype` on `device`."""
    downs, scales, blocks, at = [], [], [], 0
    for down, up, rows, scale in pairs:
        r = down.shape[0]
        downs.append(down.to(device=device, dtype=dtype))
        scales.append(torch.full((r,), scale, dtype=torch.float32, device=device))
        blocks.append(UpBlock(rows, Span(at, at + r), up.to(device=device, dtype=dtype)))
        at += r
    return LowRankBranch(torch.cat(downs), torch.cat(scales), blocks)


def _merged(blocks: Sequence[UpBlock]) -> list[UpBlock]:
    """Blocks of the same output rows over adjacent ranks joined into one (one GEMM instead of two)."""
    out: list[UpBlock] = []
    for block in sorted(blocks, key=lambda b: (b.rows.start, b.rows.stop, b.ranks.start)):
        last = out[-1] if out else None
        if last is not None and last.rows == block.rows and last.ranks.stop == block.ranks.start:
            out[-1] = UpBlock(last.rows, Span(last.ranks.start, block.ranks.stop), torch.cat([last.up, block.up], dim=1))
        else:
            out.append(block)
    return out
