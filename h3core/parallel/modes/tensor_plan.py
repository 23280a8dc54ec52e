"""Tensor mode's planning (torch-free): each rank's shards of the block linears, the bytes each rank
holds, its activation memory and its rounding.

Which linears split, and how, is `h3core.parallel.modes.tensor_shards.TENSOR_PARALLEL`: QKV and FC1
column-parallel (rows selected, bias sliced with them), Out and FC2 row-parallel (block-aligned input
columns, bias added once after the reduction). Each rank's ranges (`TensorShards`) come from
`h3core.parallel.partition` once, in the plan; `h3core.parallel.modes.tensor` (`apply_tensor`)
reads them as they are and never recomputes a split.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from h3core.nvfp4.layout import ColumnSlice
from h3core.parallel import partition
from h3core.parallel.modes.contract import BlockShape, PlanTable
from h3core.parallel.modes.tensor_shards import TENSOR_PARALLEL, Split, TensorShards, tensor_parallel_prefixes
from h3core.span import Span

if TYPE_CHECKING:
    from h3core.model.checkpoint import TensorSpec
    from h3core.model.config import ModelConfig


def tensor_shards(config: "ModelConfig", heads: Sequence[Span]) -> list[TensorShards]:
    """Every rank's ranges of the block linears: heads decide qkv rows and out_proj columns; fc2
    columns are whole NVFP4 blocks of F, and fc1's rows follow them in both halves."""
    world = len(heads)
    out_columns = partition.head_column_slices(config.num_heads, config.head_dim, world)
    fc2_columns = partition.nvfp4_column_slices(config.ffn_dim, world)
    return [
        TensorShards(
            qkv_rows=partition.fused_qkv_rows(h, config.num_heads, config.head_dim),
            attn_out_columns=out, fc1_rows=partition.gate_up_rows(fc2, config.ffn_dim), fc2_columns=fc2,
        )
        for h, out, fc2 in zip(heads, out_columns, fc2_columns)
    ]


def shard_bytes(spec: "TensorSpec", shards: TensorShards, config: "ModelConfig") -> int:
    """Bytes of one block-linear tensor a rank holds: its rows (column-parallel) or columns (row-parallel)
    as a share of the whole; 0-dim scales and markers whole."""
    linear = spec.prefix.split(".", 2)[2]  # blocks.<i>.<linear>
    if len(spec.shape) == 0 or spec.name.endswith(".comfy_quant"):
        return spec.nbytes
    if TENSOR_PARALLEL[linear] is Split.COLUMN:
        rows = {"attn.qkv_proj": 3 * config.attention_width, "mlp.fc1": 2 * config.ffn_dim}[linear]
        return spec.nbytes * sum(len(s) for s in shards.rows_of(linear)) // rows
    if spec.name.endswith(".bias"):
        return spec.nbytes
    width = {"attn.out_proj": config.attention_width, "mlp.fc2": config.ffn_dim}[linear]
    return spec.nbytes * len(shards.columns_of(linear).elements) // width


def _columns(c: ColumnSlice) -> str:
    return f"{c.elements} · {c.packed_bytes} · {c.scale_columns}"


class TensorPlanning:
    """Token rows per rank between blocks; inside, each rank's heads and fc range of the block linears."""

    summary = "block linears split by heads and NVFP4 blocks (1/N each), rows gathered and partials reduce-scattered per block"

    def shards(self, config: "ModelConfig", heads: Sequence[Span]) -> list[TensorShards | None]:
        return list(tensor_shards(config, heads))

    def weights_per_rank(self, specs: Sequence["TensorSpec"], shards: Sequence[TensorShards | None], config: "ModelConfig") -> list[tuple[int, int]]:
        split = tensor_parallel_prefixes(config.num_blocks)
        block = [s for s in specs if s.name.startswith(split)]
        total, dense16 = sum(s.nbytes for s in specs), sum(s.nbytes for s in specs if s.dtype in ("BF16", "F16"))
        out = []
        for mine in shards:
            assert mine is not None, "tensor mode plans shards for every rank"
            held = [shard_bytes(s, mine, config) for s in block]
            block16 = [(h, s) for h, s in zip(held, block) if s.dtype in ("BF16", "F16")]
            out.append((total - sum(s.nbytes for s in block) + sum(held),
                        dense16 - sum(s.nbytes for _, s in block16) + sum(h for h, _ in block16)))
        return out

    def plan_tables(self, shards: Sequence[TensorShards | None]) -> list[PlanTable]:
        rows = [[str(rank), " | ".join(map(str, s.qkv_rows)), _columns(s.attn_out_columns), " | ".join(map(str, s.fc1_rows)), _columns(s.fc2_columns)]
                for rank, s in enumerate(shards) if s is not None]
        title = "shards per block (rows of column-parallel weights; input columns as elements · packed bytes · scale columns)"
        return [(title, ["rank", "qkv_proj rows q | k | v", "out_proj columns", "fc1 rows gate | up", "fc2 columns"], rows)]

    def activation_elements(self, config: "ModelConfig", shape: BlockShape) -> int:
        s, s_loc, h_loc, n = shape.tokens, shape.local_tokens, shape.local_heads, shape.world_size
        d, dh, f = config.hidden, config.head_dim, config.ffn_dim
        x = 2 * s_loc * d  # the residual stream rows and their modulated copy, alive through the block
        gathered = s * d if n > 1 else 0  # the all-gathered sequence (one rank: the identity, no copy)
        attn = x + gathered + s * 3 * h_loc * dh + s * h_loc * dh + s * d  # + q|k|v of its heads, their output, the partial
        mlp = x + gathered + s * 3 * -(-f // n) + s * d  # + its fc1 rows' output [S, 2F/N] and activation [S, F/N], the partial
        return max(attn, mlp)

    def rounding_ulps(self, itemsize: int) -> float:
        # fp32 on this project's CPUs: row-parallel partials summed in another order than one GEMM, up to
        # 5.25 eps (an AVX2 Xeon) and 6.82 eps (an AVX-512 Xeon, MKL 2024.2): MKL's blocking follows the
        # CPU, so the bound is kept above both; 16-bit: each partial rounded, the fp32 sum rounded once
        # (0.99 units measured).
        return 8.0 if itemsize == 4 else 1.0

    def left_out_at_load(self, num_blocks: int) -> tuple[str, ...]:
        return tensor_parallel_prefixes(num_blocks)
