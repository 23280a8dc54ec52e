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

from h3core.model.dit import TENSOR_PARALLEL, H3Model, ProjectedQKV
from h3core.parallel.collectives import exchange_blocks, head_to_seq, send_blocks, seq_to_head
from h3core.parallel.modes.registry import Mode, ParallelMode, register


class UlyssesAttention(nn.Module):
    """Wraps an attention core: q, k, v [S_loc, H, Dh] -> [S_loc, H, Dh], attending over all S tokens."""

    def __init__(self, inner: nn.Module, runtime: "ParallelRuntime"):  # noqa: F821 - h3core.parallel.runtime
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


def apply_ulysses(model: H3Model, runtime: "ParallelRuntime") -> H3Model:  # noqa: F821
    """Wrap every block's attention core; the rest of the model already works on local rows."""
    for block in model.blocks:
        block.attn.core = UlyssesAttention(block.attn.core, runtime)
    return model


class UlyssesMode(ParallelMode):
    """Every weight on every rank; token rows per rank; per block two all-to-alls around attention."""

    name = "ulysses"
    summary = "weights replicated, tokens sharded, q|k|v to heads and back per block (two all-to-alls)"

    def shards(self, config, heads):  # type: ignore[no-untyped-def]
        return [None] * len(heads)

    def weights_per_rank(self, specs, ranks, config):  # type: ignore[no-untyped-def]
        whole = (sum(s.nbytes for s in specs), sum(s.nbytes for s in specs if s.dtype in ("BF16", "F16")))
        return [whole] * len(ranks)

    def activation_elements(self, config, plan, tokens):  # type: ignore[no-untyped-def]
        s, s_loc, h_loc = tokens, max(len(t) for seq in plan.sequences for t in seq.tokens), max(plan.heads)
        d, a, dh, f = config.hidden, config.attention_width, config.head_dim, config.ffn_dim
        x = 2 * s_loc * d  # the residual stream rows and their modulated copy, alive through the block
        received = s * 3 * h_loc * dh if plan.world_size > 1 else 0  # q|k|v of its heads over the whole sequence (one rank: the identity)
        attn = x + s_loc * 3 * a + received + s * h_loc * dh  # + its q|k|v rows, the attention output
        mlp = x + s_loc * 3 * f  # + fc1 output [S_loc, 2F] and activation [S_loc, F]
        return max(attn, mlp)

    def rounding_ulps(self, dtype):  # type: ignore[no-untyped-def]
        # fp32 on this project's CPU (MKL): a GEMM on a rank's rows differs from those rows of the
        # whole product by up to 4.98 eps; 16-bit kernels accumulate in fp32 and round once (0 measured).
        return 6.0 if dtype.itemsize == 4 else 1.0

    def apply(self, model, runtime, weights):  # type: ignore[no-untyped-def]
        apply_ulysses(model, runtime)

    def input_split_linears(self, model):  # type: ignore[no-untyped-def]
        return [block.get_submodule(name) for block in model.blocks for name in TENSOR_PARALLEL]  # each sees its rows only


Mode.ULYSSES = Mode(register(UlyssesMode()).name)
