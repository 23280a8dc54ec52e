"""NVFP4 tensor parallelism on token-sharded blocks (DESIGN.md §5).

Between blocks every rank holds its own token rows, as in Ulysses. Inside a block:

    attention:  h_loc --gather rows--> h [S, D] --QKV rows of my heads--> q,k,v [S, H_loc, Dh]
                --norm, RoPE (whole-sequence table), attention--> o [S, H_loc*Dh]
                --Out columns of my heads (no bias)--> partial [S, D] --reduce-scatter--> [S_loc, D] + bias
    MLP:        h_loc --gather rows--> h [S, D] --FC1 rows: my F-range of gate and of value--> [S, 2F_loc]
                --silu(gate)*value--> [S, F_loc] --FC2 my F columns (no bias)--> partial [S, D]
                --reduce-scatter--> [S_loc, D] + bias

Which linears split, and how, is the model's declaration (`h3core.model.dit.TENSOR_PARALLEL`): QKV and
FC1 column-parallel (rows selected, bias sliced with them), Out and FC2 row-parallel (block-aligned
input columns, bias added once after the reduction). The ranges are this rank's `TensorShards` of
the run's plan, never recomputed here. Every shard is byte-for-byte a slice of the full packed
NVFP4 tensors, read straight from the checkpoint when one is given (so per-rank weight bytes read
and held fall as 1/N); the slicing is `h3core.nvfp4`'s.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn as nn

from h3core.model.dit import TENSOR_PARALLEL, H3Model, Split
from h3core.nvfp4.io import WeightSource
from h3core.nvfp4.layout import ColumnSlice
from h3core.nvfp4.linear import DenseLinear, NVFP4Linear
from h3core.nvfp4.shard import column_parallel, row_parallel
from h3core.parallel.collectives import gather_rows, reduce_scatter_rows
from h3core.parallel.plan import TensorShards
from h3core.parallel.runtime import ParallelRuntime
from h3core.span import Span


def block_linears(model: H3Model) -> list[nn.Module]:
    """The modules tensor mode shards: each block's QKV, Out, FC1, FC2 (biases of Out/FC2 sit on attn/mlp)."""
    return [block.get_submodule(name) for block in model.blocks for name in TENSOR_PARALLEL]


class ModelWeights:
    """A `WeightSource` over an in-memory model: shards cut from its full linears (tests, verification)."""

    def __init__(self, model: H3Model):
        self.model = model
        self.state = model.state_dict()

    def has(self, name: str) -> bool:
        return self.state.get(name) is not None

    def tensor(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        return self.state[name].to(dtype=dtype, copy=True)

    def linear(self, prefix: str, *, rows: Sequence[Span] | None = None, columns: ColumnSlice | None = None) -> nn.Module:
        full = self.model.get_submodule(prefix)
        if isinstance(full, DenseLinear):
            return full.rows(rows) if rows is not None else full.columns(columns.elements) if columns is not None else full
        if rows is not None:
            return column_parallel(full, rows)
        return row_parallel(full, columns)[0] if columns is not None else full


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


def read_shard(weights: WeightSource, prefix: str, split: Split, part: list[Span] | ColumnSlice, dtype: torch.dtype) -> tuple[nn.Module, torch.Tensor | None]:
    """This rank's shard of linear `prefix`, and the bias to add after the reduction (row-parallel only)."""
    if split is Split.COLUMN:
        return weights.linear(prefix, rows=part), None
    bias = f"{prefix}.bias"
    return weights.linear(prefix, columns=part), weights.tensor(bias, dtype) if weights.has(bias) else None


def _check_shard(prefix: str, shard: nn.Module, split: Split, part: list[Span] | ColumnSlice) -> None:
    """A shard must hold exactly the rows or columns the plan gave it (what `RankUsage.shards` records)."""
    held, want = (shard.out_features, sum(len(s) for s in part)) if split is Split.COLUMN else (shard.in_features, len(part.elements))
    if held != want:
        raise RuntimeError(f"{prefix}: the shard read holds {held} {'rows' if split is Split.COLUMN else 'columns'}, the plan gives {want}")


def apply_tensor(model: H3Model, runtime: ParallelRuntime, weights: WeightSource) -> H3Model:
    """Replace each block's `TENSOR_PARALLEL` linears by this rank's NVFP4 shards (ranges from the
    plan) and hook in the collectives around attention and MLP."""
    shards: TensorShards = runtime.plan.ranks[runtime.rank].tensor  # type: ignore[assignment]
    dtype = model.dtype
    for i, block in enumerate(model.blocks):
        biases = {}
        for name, split in TENSOR_PARALLEL.items():
            part = shards.of(name)
            parent, leaf = name.split(".")
            shard, biases[name] = read_shard(weights, f"blocks.{i}.{name}", split, part, dtype)
            _check_shard(f"blocks.{i}.{name}", shard, split, part)
            setattr(block.get_submodule(parent), leaf, shard)
        _hook_block(block, runtime, biases["attn.out_proj"], biases["mlp.fc2"])
    q_rows = shards.qkv_rows[0]  # the q third: this rank's heads x head_dim
    runtime.used.shards = shards
    runtime.used.heads = Span(q_rows.start // runtime.plan.head_dim, q_rows.stop // runtime.plan.head_dim)
    return model


def _hook_block(block: nn.Module, runtime: ParallelRuntime, out_bias: torch.Tensor | None, fc2_bias: torch.Tensor | None) -> None:
    attn, mlp = block.attn, block.mlp
    attn.register_buffer("out_bias", out_bias)
    mlp.register_buffer("fc2_bias", fc2_bias)
    attn.register_forward_pre_hook(_GatherRows(runtime, whole_rope=True))
    attn.register_forward_hook(_ReduceScatterBias(runtime, "out_bias"))
    mlp.register_forward_pre_hook(_GatherRows(runtime, whole_rope=False))
    mlp.register_forward_hook(_ReduceScatterBias(runtime, "fc2_bias"))
