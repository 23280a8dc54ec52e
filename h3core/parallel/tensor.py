"""NVFP4 tensor parallelism on token-sharded blocks (DESIGN.md §5).

Between blocks every rank holds its own token rows, as in Ulysses. Inside a block:

    attention:  h_loc --gather rows--> h [S, D] --QKV rows of my heads--> q,k,v [S, H_loc, Dh]
                --norm, RoPE (whole-sequence table), attention--> o [S, H_loc*Dh]
                --Out columns of my heads (no bias)--> partial [S, D] --reduce-scatter--> [S_loc, D] + bias
    MLP:        h_loc --gather rows--> h [S, D] --FC1 rows: my F-range of gate and of value--> [S, 2F_loc]
                --silu(gate)*value--> [S, F_loc] --FC2 my F columns (no bias)--> partial [S, D]
                --reduce-scatter--> [S_loc, D] + bias

QKV and FC1 are column-parallel (rows selected, bias sliced with them); Out and FC2 are
row-parallel (block-aligned input columns, bias added once after the reduction). Every shard is
byte-for-byte a slice of the full packed NVFP4 tensors, read straight from the checkpoint when
one is given (so per-rank weight bytes read and held fall as 1/N). The ranges come from
`h3core.partition`; the slicing from `h3core.nvfp4.shard`.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn as nn

from h3core import partition
from h3core.checkpoint import Checkpoint
from h3core.collectives import gather_rows, reduce_scatter_rows
from h3core.model import H3Model
from h3core.nvfp4.linear import NVFP4Linear
from h3core.nvfp4.shard import column_parallel, row_parallel
from h3core.parallel.runtime import ParallelRuntime
from h3core.partition import ColumnSlice, Span

SHARDED_LINEARS = ("attn.qkv", "attn.out", "mlp.fc1", "mlp.fc2")


def sharded_prefixes(num_blocks: int) -> tuple[str, ...]:
    """State-dict prefixes of the linears tensor mode reads as shards (the loader skips them)."""
    return tuple(f"blocks.{i}.{name}." for i in range(num_blocks) for name in SHARDED_LINEARS)


def block_linears(model: H3Model) -> list[nn.Module]:
    """The modules tensor mode shards: each block's QKV, Out, FC1, FC2 (biases of Out/FC2 sit on attn/mlp)."""
    return [block.get_submodule(name) for block in model.blocks for name in SHARDED_LINEARS]


class WeightSource(Protocol):
    def column_parallel(self, prefix: str, rows: list[Span]) -> NVFP4Linear: ...
    def row_parallel(self, prefix: str, columns: ColumnSlice) -> tuple[NVFP4Linear, torch.Tensor | None]: ...


class ModelWeights:
    """Shards cut from the full linears of an in-memory model (tests, verification)."""

    def __init__(self, model: H3Model):
        self.model = model

    def column_parallel(self, prefix: str, rows: list[Span]) -> NVFP4Linear:
        return column_parallel(self.model.get_submodule(prefix), rows)

    def row_parallel(self, prefix: str, columns: ColumnSlice) -> tuple[NVFP4Linear, torch.Tensor | None]:
        return row_parallel(self.model.get_submodule(prefix), columns)


class CheckpointWeights:
    """Shards read from disk: only this rank's rows or block-aligned columns are ever read."""

    def __init__(self, checkpoint: Checkpoint, device: torch.device, dtype: torch.dtype):
        self.checkpoint = checkpoint
        self.device = device
        self.dtype = dtype

    def column_parallel(self, prefix: str, rows: list[Span]) -> NVFP4Linear:
        return self.checkpoint.read_linear(prefix, rows=rows, device=self.device)

    def row_parallel(self, prefix: str, columns: ColumnSlice) -> tuple[NVFP4Linear, torch.Tensor | None]:
        shard = self.checkpoint.read_linear(prefix, columns=columns, device=self.device)
        bias_name = f"{prefix}.bias"
        has_bias = bias_name in self.checkpoint.reader.keys()
        bias = self.checkpoint.tensor(bias_name, device=self.device, dtype=self.dtype) if has_bias else None
        return shard, bias


class _GatherRows:
    """Forward pre-hook: replace the module's local input rows by every rank's rows."""

    def __init__(self, runtime: ParallelRuntime, whole_rope: bool):
        self.runtime = runtime
        self.whole_rope = whole_rope

    def __call__(self, module: nn.Module, args: tuple) -> tuple:
        rt = self.runtime
        h = gather_rows(args[0], rt.tokens, rt.group, rt.stats)  # [S_loc, D] -> [S, D]
        return (h, args[1].whole()) if self.whole_rope else (h,)


class _ReduceScatterBias:
    """Forward hook: sum the row-parallel partials, keep this rank's token rows, add the bias once.

    The bias is a buffer of the hooked module (`bias_name`), so it moves and is counted with it.
    """

    def __init__(self, runtime: ParallelRuntime, bias_name: str):
        self.runtime = runtime
        self.bias_name = bias_name

    def __call__(self, module: nn.Module, args: tuple, partial: torch.Tensor) -> torch.Tensor:
        rt = self.runtime
        out = reduce_scatter_rows(partial, rt.tokens, rt.group, rt.stats)  # [S, D] -> [S_loc, D]
        bias = getattr(module, self.bias_name)
        return out if bias is None else out + bias


def apply_tensor(model: H3Model, runtime: ParallelRuntime, weights: WeightSource) -> H3Model:
    """Replace each block's four big linears by this rank's NVFP4 shards and hook in the collectives."""
    cfg = model.config
    heads = runtime.heads[runtime.rank]
    qkv_rows = partition.fused_qkv_rows(heads, cfg.num_heads, cfg.head_dim)
    out_columns = partition.head_column_slices(cfg.num_heads, cfg.head_dim, runtime.world_size)[runtime.rank]
    fc2_columns = partition.nvfp4_column_slices(cfg.mlp_width, runtime.world_size)[runtime.rank]
    fc1_rows = partition.gate_value_rows(fc2_columns, cfg.mlp_width)
    for i, block in enumerate(model.blocks):
        attn, mlp = block.attn, block.mlp
        attn.qkv = weights.column_parallel(f"blocks.{i}.attn.qkv", qkv_rows)
        attn.out, out_bias = weights.row_parallel(f"blocks.{i}.attn.out", out_columns)
        mlp.fc1 = weights.column_parallel(f"blocks.{i}.mlp.fc1", fc1_rows)
        mlp.fc2, fc2_bias = weights.row_parallel(f"blocks.{i}.mlp.fc2", fc2_columns)
        attn.register_buffer("out_bias", out_bias)
        mlp.register_buffer("fc2_bias", fc2_bias)
        attn.register_forward_pre_hook(_GatherRows(runtime, whole_rope=True))
        attn.register_forward_hook(_ReduceScatterBias(runtime, "out_bias"))
        mlp.register_forward_pre_hook(_GatherRows(runtime, whole_rope=False))
        mlp.register_forward_hook(_ReduceScatterBias(runtime, "fc2_bias"))
    # Row-parallel shards see their columns of the full rows, the text embedding its token rows;
    # QKV and FC1 see gathered full rows and the conditioning is replicated: no agreement needed.
    row_parallel = [layer for block in model.blocks for layer in (block.attn.out, block.mlp.fc2)]
    runtime.agree_activation_scales(model, [model.text_embed, *row_parallel])
    runtime.guard_rows(model)
    return model
