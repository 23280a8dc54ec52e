"""Ulysses' planning (torch-free): every weight on every rank, its activation memory and its rounding.

What it computes is `h3core.parallel.modes.ulysses` (`apply_ulysses`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from h3core.parallel.modes.contract import BlockShape, PlanTable

if TYPE_CHECKING:
    from h3core.model.checkpoint import TensorSpec
    from h3core.model.config import ModelConfig
    from h3core.parallel.modes.tensor_shards import TensorShards
    from h3core.span import Span


class UlyssesPlanning:
    """Every weight on every rank; token rows per rank; per block two all-to-alls around attention."""

    summary = "weights replicated, tokens sharded, q|k|v to heads and back per block (two all-to-alls)"

    def shards(self, config: "ModelConfig", heads: Sequence["Span"]) -> list["TensorShards | None"]:
        return [None] * len(heads)

    def weights_per_rank(self, specs: Sequence["TensorSpec"], shards: Sequence["TensorShards | None"], config: "ModelConfig") -> list[tuple[int, int]]:
        whole = (sum(s.nbytes for s in specs), sum(s.nbytes for s in specs if s.dtype in ("BF16", "F16")))
        return [whole] * len(shards)

    def plan_tables(self, shards: Sequence["TensorShards | None"]) -> list[PlanTable]:
        return []

    def activation_elements(self, config: "ModelConfig", shape: BlockShape) -> int:
        s, s_loc, h_loc = shape.tokens, shape.local_tokens, shape.local_heads
        d, a, dh, f = config.hidden, config.attention_width, config.head_dim, config.ffn_dim
        x = 2 * s_loc * d  # the residual stream rows and their modulated copy, alive through the block
        received = s * 3 * h_loc * dh if shape.world_size > 1 else 0  # q|k|v of its heads over the whole sequence (one rank: the identity)
        attn = x + s_loc * 3 * a + received + s * h_loc * dh  # + its q|k|v rows, the attention output
        if shape.overlapped:  # the returns of every head group arrive into one buffer, alive with the send blocks
            attn += s_loc * a
        mlp = x + s_loc * 3 * f  # + fc1 output [S_loc, 2F] and activation [S_loc, F]
        return max(attn, mlp)

    def rounding_ulps(self, itemsize: int) -> float:
        # fp32 on this project's CPUs (MKL): a GEMM on a rank's rows differs from those rows of the
        # whole product by up to 4.98 eps (an AVX2 Xeon) and 5.77 eps (an AVX-512 Xeon): kept above
        # both, as tensor mode's; 16-bit kernels accumulate in fp32 and round once (0 measured).
        return 8.0 if itemsize == 4 else 1.0

    def left_out_at_load(self, num_blocks: int) -> tuple[str, ...]:
        return ()
