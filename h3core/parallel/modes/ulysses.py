"""Ulysses sequence parallelism, applied: token-sharded blocks; attention sees every token of its own heads.

Per block on rank r: AdaLN, the full QKV, q/k norm and RoPE all run on r's tokens; one all-to-all
sends q|k|v sequence->head (r now holds every token of its heads, ragged heads and tokens both
allowed), attention runs, the inverse all-to-all returns head->sequence, and the output projection,
gate and MLP run on r's tokens again. Weights are replicated.

`apply_ulysses` swaps every block's attention processor for a `UlyssesProcessor` (the model file
is not touched: it calls its processor, whatever it is). The processor writes q and k through RoPE,
and v through its GEMM, straight into the all-to-all's send buffer (`ProjectedQKV.write` into
`send_blocks`), instead of finishing q|k|v, stacking them and packing the stack (two passes over
3x the activations saved); bit-identical to exchanging the finished q, k, v (`attend`). At one
rank it is the model's own processor: nothing to exchange.

Overlap (`--ulysses-overlap`, `h3core.parallel.overlap`): with the runtime's head groups the two
all-to-alls are split by head group and started asynchronously, so that attention on one group
runs while the next is in flight (`attend_in_groups`); bitwise the whole path's output.

Planning (whole replicas, activation memory, rounding) is `h3core.parallel.modes.ulysses_plan`.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch

from h3core.model.attention.dispatch import AttentionKernel
from h3core.model.compile_regions import outside_compiled
from h3core.model.dit import Attention, AttentionProcessor, H3Model
from h3core.model.inputs import Rope
from h3core.model.rope import apply_rope
from h3core.nvfp4.linear import NVFP4Linear
from h3core.parallel.collectives import (
    CommStats, Scratch, exchange_blocks, head_to_seq, send_blocks, seq_to_head, start_exchange_blocks, start_head_to_seq, transient,
)
from h3core.span import Span

if TYPE_CHECKING:
    from h3core.parallel.runtime import ParallelRuntime


# --- q|k|v one step before they are final ---------------------------------------------------------


@dataclass(frozen=True)
class LinearHeads:
    """Heads of a linear's output not computed yet: features `[first, first + H * Dh)` of
    `linear(h)`, as [S, H, Dh]. `compute()` gives them as a new tensor; `into()` lets the GEMM write
    a range of heads straight into a destination laid out differently (no copy on the dequant paths)."""

    linear: NVFP4Linear
    h: torch.Tensor  # [S, D_in], the linear's input rows
    first: int  # first output feature of head 0
    num_heads: int
    head_dim: int

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.h.shape[0], self.num_heads, self.head_dim)

    def _features(self, first_head: int, count: int) -> slice:
        start = self.first + first_head * self.head_dim
        return slice(start, start + count * self.head_dim)

    def compute(self) -> torch.Tensor:
        return self.linear.forward_rows(self.h, self._features(0, self.num_heads)).unflatten(-1, (-1, self.head_dim))

    def into(self, heads: slice, out: torch.Tensor) -> None:
        """Heads `heads` into out: [S, *group, w, Dh], any strides, heads grouped as `(*group, w)`
        (e.g. `(peers, heads_per_peer)`). One GEMM per group of w heads, into its `[S, w * Dh]` view."""
        width, start = out.shape[-2], heads.start
        for index in itertools.product(*(range(n) for n in out.shape[1:-2])):
            dest = out[(slice(None), *index)]  # [S, w, Dh]
            rows = self._features(start, width)
            if dest.stride(-1) == 1 and dest.stride(-2) == self.head_dim:
                self.linear.forward_rows(self.h, rows, out=dest.view(dest.shape[0], width * self.head_dim))
            else:  # heads not laid out row by row: no matrix view of them exists
                dest.copy_(self.linear.forward_rows(self.h, rows).unflatten(-1, (width, self.head_dim)))
            start += width


@dataclass
class ProjectedQKV:
    """Attention inputs of some rows one step before they are final: q and k normalised, not yet
    rotated; v a tensor, or `LinearHeads` still to be computed. `cos`/`sin` None: no RoPE.

    `split()` finishes them into q, k, v: [S, H, Dh] each. `write(heads, out)` writes the same
    values for a range of heads into a destination laid out differently, e.g. an all-to-all's send
    buffer, so that nothing is copied on the way out.
    """

    q: torch.Tensor  # [S, H, Dh], RMS-normalised
    k: torch.Tensor  # [S, H, Dh], RMS-normalised
    v: torch.Tensor | LinearHeads  # [S, H, Dh]
    cos: torch.Tensor | None  # [S, R/2]
    sin: torch.Tensor | None

    def _rope(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        if self.cos is None or self.sin is None:
            return x if out is None else out.copy_(x)
        return apply_rope(x, self.cos, self.sin, out=out)

    def split(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        v = self.v.compute() if isinstance(self.v, LinearHeads) else self.v
        return self._rope(self.q), self._rope(self.k), v

    def write(self, heads: slice, out: torch.Tensor) -> None:
        """Heads `heads` of q, k (rotated) and v into out: [S, 3, *group, Dh], any strides, with the
        heads grouped as `group` (e.g. `(peers, heads_per_peer)`); bit-identical to `split()`."""
        group = tuple(out.shape[2:-1])
        self._rope(self.q[:, heads].unflatten(1, group), out=out[:, 0])
        self._rope(self.k[:, heads].unflatten(1, group), out=out[:, 1])
        if isinstance(self.v, LinearHeads):
            self.v.into(heads, out[:, 2])
        else:
            out[:, 2].copy_(self.v[:, heads].unflatten(1, group))


def project_qkv(attn: Attention, h: torch.Tensor, rope: Rope | None) -> ProjectedQKV:
    """`attn`'s q|k|v of rows h [S, D], q and k normalised, not yet rotated. Where the linear computes
    output rows apart bitwise (`NVFP4Linear.rows_apart`: the dequant paths) q|k come from one GEMM
    and v stays `LinearHeads`, so that its GEMM writes where the caller says."""
    cos, sin = rope.local() if rope is not None else (None, None)
    width, head_dim = attn.qkv_proj.out_features // 3, attn.head_dim
    if not (isinstance(attn.qkv_proj, NVFP4Linear) and attn.qkv_proj.rows_apart):
        q, k, v = attn.qkv_proj(h).unflatten(-1, (3, -1, head_dim)).unbind(1)  # [S, H, Dh] each
        return ProjectedQKV(attn.q_norm(q), attn.k_norm(k), v, cos, sin)
    q, k = attn.qkv_proj.forward_rows(h, slice(0, 2 * width)).unflatten(-1, (2, -1, head_dim)).unbind(1)
    return ProjectedQKV(attn.q_norm(q), attn.k_norm(k), LinearHeads(attn.qkv_proj, h, 2 * width, width // head_dim, head_dim), cos, sin)


# --- the all-to-alls around attention ---------------------------------------------------------------


Kernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""Attention on q, k, v [S, H, Dh] -> [S, H, Dh] (an `AttentionKernel`)."""


@dataclass(frozen=True)
class Exchange:
    """What Ulysses' all-to-alls need on one rank: its process group, every rank's heads, and its
    counters and CPU scratch buffer (a `ParallelRuntime`'s, or a benchmark's own)."""

    group: Any
    heads: list[Span]
    stats: CommStats | None
    scratch: Scratch | None


def attend_whole(qkv: ProjectedQKV, tokens: list[Span], kernel: Kernel, via: Exchange) -> torch.Tensor:
    """One all-to-all each way: RoPE writes q and k straight into the send blocks and v's GEMM writes
    there too (one GEMM per peer on the dequant paths; computed and copied on the fp4 paths);
    bit-identical to `attend(*qkv.split(), tokens)`. -> [S_loc, H, Dh]"""
    local_tokens, _, head_dim = qkv.q.shape
    blocks = send_blocks(local_tokens, (3,), head_dim, via.heads, qkv.q, via.scratch)
    for heads, view in blocks.pieces:
        qkv.write(heads, view)  # view: [S_loc, 3, peers, H_j, Dh]
    by_head = exchange_blocks(blocks, tokens, via.heads, via.group, via.stats)  # [S, 3, H_loc, Dh]
    out = kernel(*by_head.unbind(1))  # [S, H_loc, Dh]
    return head_to_seq(out, tokens, via.heads, via.group, via.stats, via.scratch)  # [S_loc, H, Dh]


def attend_in_groups(qkv: ProjectedQKV, tokens: list[Span], kernel: Kernel, via: Exchange, groups: list[list[Span]]) -> torch.Tensor:
    """`attend_whole` with the all-to-alls split by head groups (`partition.head_groups`) and in
    flight while this rank computes: every group's q|k|v is written and started in turn (group g
    travels while g+1 is written), then group g's attention runs while g+1.. are in flight and its
    output's return is started while g+1's attention runs; the returns are waited for last. Every
    head meets the same values in the same kernel: bit-identical to `attend_whole`. -> [S_loc, H, Dh]"""
    local_tokens, num_heads, head_dim = qkv.q.shape
    send_numel, back_numel = local_tokens * 3 * num_heads * head_dim, local_tokens * num_heads * head_dim
    buffers = transient(send_numel + back_numel, qkv.q, via.scratch)  # one take: both live at once
    send, back = buffers[:send_numel], buffers[send_numel:]
    arriving = []
    for spans in groups:
        blocks = send_blocks(local_tokens, (3,), head_dim, spans, qkv.q, into=send)
        for heads, view in blocks.pieces:
            qkv.write(heads, view)  # view: [S_loc, 3, 1, H_jg, Dh]: one peer's heads of the group
        arriving.append(start_exchange_blocks(blocks, tokens, spans, via.group, via.stats))
        send = send[blocks.buffer.numel():]
    out = qkv.q.new_empty(local_tokens, num_heads, head_dim)
    returning = []
    for spans, flight in zip(groups, arriving):
        by_head = flight.wait()  # [S, 3, H_g, Dh]
        returning.append(start_head_to_seq(kernel(*by_head.unbind(1)), tokens, spans, out, back, via.group, via.stats))
        back = back[local_tokens * sum(len(h) for h in spans) * head_dim:]
    for flight in returning:
        flight.wait()
    return out


# --- the processor -----------------------------------------------------------------------------------


class UlyssesProcessor(AttentionProcessor):
    """An attention processor whose rows attend over every token of the sequence (module docstring):
    h [S_loc, D] -> [S_loc, D]. The sequence's token spans come with the call (`rope.num_tokens`);
    with more than one head group (`runtime.head_groups`, `--ulysses-overlap`) the all-to-alls are
    overlapped with attention (`attend_in_groups`)."""

    def __init__(self, kernel: AttentionKernel, runtime: "ParallelRuntime"):
        super().__init__(kernel)
        self.runtime = runtime

    def forward(self, attn: Attention, h: torch.Tensor, rope: Rope | None) -> torch.Tensor:
        if self.runtime.world_size == 1 or rope is None:  # one rank: the model's own processor
            return super().forward(attn, h, rope)
        o = self.attend_projected(project_qkv(attn, h, rope), self.runtime.token_spans(rope.num_tokens))  # [S_loc, H, Dh]
        return attn.out_proj(o.flatten(1))

    @property
    def exchange(self) -> Exchange:
        rt = self.runtime
        return Exchange(rt.group, rt.heads, rt.stats, rt.scratch)

    @outside_compiled  # the exchange: outside any compiled region (h3core.model.compiled)
    def attend_projected(self, qkv: ProjectedQKV, tokens: list[Span]) -> torch.Tensor:
        """The model's path: `attend_in_groups` with the runtime's head groups when there are several,
        else `attend_whole`. -> [S_loc, H, Dh]"""
        groups = self.runtime.head_groups
        if len(groups) > 1:
            return attend_in_groups(qkv, tokens, self.kernel, self.exchange, groups)
        return attend_whole(qkv, tokens, self.kernel, self.exchange)

    @outside_compiled  # the exchange: outside any compiled region (h3core.model.compiled)
    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tokens: list[Span]) -> torch.Tensor:
        """Finished q, k, v [S_loc, H, Dh] -> [S_loc, H, Dh], attending over all S tokens: one stacked
        all-to-all each way (`tokens`: every rank's rows of the sequence)."""
        rt = self.runtime
        if rt.world_size == 1:
            return self.kernel(q, k, v)
        qkv = torch.stack([q, k, v], dim=1)  # [S_loc, 3, H, Dh]: one all-to-all for all three
        qkv = seq_to_head(qkv, tokens, rt.heads, rt.group, rt.stats, rt.scratch)  # [S, 3, H_loc, Dh]
        out = self.kernel(*qkv.unbind(1))  # [S, H_loc, Dh]
        return head_to_seq(out, tokens, rt.heads, rt.group, rt.stats, rt.scratch)  # [S_loc, H, Dh]


def apply_ulysses(model: H3Model, runtime: "ParallelRuntime") -> H3Model:
    """Give every block's attention a `UlyssesProcessor` around its kernel; the rest of the model
    already works on local rows. Records the heads this rank attends (its block of the all-to-all)."""
    for block in model.blocks:
        block.attn.processor = UlyssesProcessor(block.attn.processor.kernel, runtime)
    runtime.used.heads = runtime.heads[runtime.rank]
    return model
