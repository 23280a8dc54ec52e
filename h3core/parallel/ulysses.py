"""Ulysses sequence parallelism: token-sharded blocks; attention sees every token of its own heads.

Per block on rank r: AdaLN, the full QKV, q/k norm and RoPE all run on r's tokens; one all-to-all
sends q|k|v sequence->head (r now holds every token of its heads, ragged heads and tokens both
allowed; the model's RoPE writes q and k, and v's GEMM writes v, straight into the all-to-all's send buffer, see
`UlyssesAttention.attend_projected`), attention runs, the inverse all-to-all returns head->sequence, and the output
projection, gate and MLP run on r's tokens again. Weights are replicated.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from h3core.model.dit import H3Model, ProjectedQKV
from h3core.parallel.collectives import exchange_blocks, head_to_seq, send_blocks, seq_to_head
from h3core.parallel.runtime import ParallelRuntime


class UlyssesAttention(nn.Module):
    """Wraps an attention core: q, k, v [S_loc, H, Dh] -> [S_loc, H, Dh], attending over all S tokens."""

    def __init__(self, inner: nn.Module, runtime: ParallelRuntime):
        super().__init__()
        self.inner = inner
        self.runtime = runtime

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        rt = self.runtime
        rt.used.heads = rt.heads[rt.rank]
        if rt.world_size == 1:  # the identity path: nothing to exchange
            return self.inner(q, k, v)
        qkv = torch.stack([q, k, v], dim=1)  # [S_loc, 3, H, Dh]: one all-to-all for all three
        qkv = seq_to_head(qkv, rt.tokens, rt.heads, rt.group, rt.stats)  # [S, 3, H_loc, Dh]
        out = self.inner(*qkv.unbind(1))  # [S, H_loc, Dh]
        return head_to_seq(out, rt.tokens, rt.heads, rt.group, rt.stats)  # [S_loc, H, Dh]

    def attend_projected(self, qkv: ProjectedQKV) -> torch.Tensor:
        """The model's path: RoPE writes q and k straight into the all-to-all's send blocks and v's
        GEMM writes there too (one GEMM per peer on the dequant paths; computed and copied on the fp4
        paths), instead of finishing q|k|v, stacking them and packing the stack (two passes over 3x
        the activations saved); bit-identical to `forward(*qkv.split())`."""
        rt = self.runtime
        rt.used.heads = rt.heads[rt.rank]
        if rt.world_size == 1:
            return self.inner.attend_projected(qkv)
        local_tokens, _, head_dim = qkv.q.shape
        blocks = send_blocks(local_tokens, (3,), head_dim, rt.heads, qkv.q)
        for heads, view in blocks.pieces:
            qkv.write(heads, view)  # view: [S_loc, 3, peers, H_j, Dh]
        by_head = exchange_blocks(blocks, rt.tokens, rt.heads, rt.group, rt.stats)  # [S, 3, H_loc, Dh]
        out = self.inner(*by_head.unbind(1))  # [S, H_loc, Dh]
        return head_to_seq(out, rt.tokens, rt.heads, rt.group, rt.stats)  # [S_loc, H, Dh]


def apply_ulysses(model: H3Model, runtime: ParallelRuntime) -> H3Model:
    """Wrap every block's attention core; the rest of the model already works on local rows."""
    for block in model.blocks:
        block.attn.core = UlyssesAttention(block.attn.core, runtime)
    return model
