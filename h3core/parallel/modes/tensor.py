"""NVFP4 tensor parallelism on token-sharded blocks (DESIGN.md §5), applied: the `tensor` mode.

Between blocks every rank holds its own token rows, as in Ulysses. Inside a block:

    attention:  h_loc --gather rows--> h [S, D] --QKV rows of my heads--> q,k,v [S, H_loc, Dh]
                --norm, RoPE (whole-sequence table), attention--> o [S, H_loc*Dh]
                --Out columns of my heads (no bias)--> partial [S, D] --reduce-scatter--> [S_loc, D] + bias
    MLP:        h_loc --gather rows--> h [S, D] --FC1 rows: my F-range of gate and of value--> [S, 2F_loc]
                --silu(gate)*value--> [S, F_loc] --FC2 my F columns (no bias)--> partial [S, D]
                --reduce-scatter--> [S_loc, D] + bias

On the fp4 paths the rows gathered before QKV and FC1 travel as NVFP4 codes + block scales,
quantized on the rank that holds them with the scale agreed over the group (`_GatherRows`): bitwise
the same product for about 28% of the bf16 bytes.

Which linears split, and how, is this mode's declaration (`h3core.parallel.modes.tensor_shards.
TENSOR_PARALLEL`): QKV and FC1 column-parallel (rows selected, bias sliced with them), Out and FC2
row-parallel (block-aligned input columns, bias added once after the reduction). The ranges are
this rank's `TensorShards` of the run's plan, never recomputed here (planning:
`h3core.parallel.modes.tensor_plan`).

Which rows the collectives move comes with the call: the attention hooks read the sequence's token
spans from their input (`rope.num_tokens`), the MLP hooks, whose input is rows only, from the forward
the model's outermost hook is running (`ParallelRuntime.forward_tokens`). Every shard is byte-for-byte a slice of the full packed
NVFP4 tensors, read straight from the checkpoint when one is given (so per-rank weight bytes read
and held fall as 1/N); the slicing is `h3core.nvfp4`'s.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch
import torch.nn as nn

from h3core.model.compile_regions import outside_compiled
from h3core.model.dit import H3Model
from h3core.nvfp4.codec import NVFP4Weight
from h3core.nvfp4.io import WeightSource
from h3core.nvfp4.layout import ColumnSlice
from h3core.nvfp4.linear import DenseLinear, GatheredCodes, NVFP4Linear
from h3core.nvfp4.matmul import FP4_PATHS
from h3core.nvfp4.shard import column_parallel, row_parallel
from h3core.parallel.collectives import gather_rows, reduce_scatter_rows
from h3core.parallel.modes.tensor_shards import TENSOR_PARALLEL, Split, TensorShards
from h3core.span import Span

if TYPE_CHECKING:
    from h3core.parallel.runtime import ParallelRuntime


def block_linears(model: H3Model) -> list[nn.Module]:
    """Each block's QKV, Out, FC1, FC2 (`TENSOR_PARALLEL`): what tensor mode shards, and in either mode
    the linears whose input the ranks split (rows in Ulysses, rows or columns here)."""
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


QUANTIZE_BEFORE_GATHER = True
"""On the fp4 paths, gather NVFP4 codes + scales instead of the rows (`_GatherRows`). False only to
compare with the rows gathered first (the test of bitwise equality)."""


class _GatherRows:
    """Forward pre-hook: replace the module's local input rows by every rank's rows.

    Where the module's first linear (`linear`: qkv_proj, fc1) takes an fp4 path, the rows are
    quantized here first, with the activation scale agreed over the group (`agree_amax`: the amax of
    the whole input), and their packed codes and row-major block scales are gathered (one ragged
    all-gather of `K/2 + K/16` bytes a row instead of `2K` in bf16, `4K` in fp32): every element
    depends on its 16-element block and that scale only, so the gathered codes are bitwise those of
    the gathered rows (`h3core.nvfp4.activation.quantize_local_rows`). The linear receives them as
    `GatheredCodes` and runs its GEMM on them (`NVFP4Linear.forward_gathered`)."""

    def __init__(self, runtime: "ParallelRuntime", whole_rope: bool, linear: str):
        self.runtime = runtime
        self.whole_rope = whole_rope  # attention: its input carries the sequence's RoPE table; the MLP's does not
        self.linear = linear

    @outside_compiled  # a collective: outside any compiled region (h3core.model.compiled)
    def __call__(self, module: nn.Module, args: tuple) -> tuple:
        rt = self.runtime
        tokens = rt.token_spans(args[1].num_tokens) if self.whole_rope else rt.forward_tokens
        first = module.get_submodule(self.linear)
        if QUANTIZE_BEFORE_GATHER and isinstance(first, NVFP4Linear) and first.path in FP4_PATHS:
            low = first.lora.project(args[0].reshape(-1, first.in_features)) if first.lora is not None else None  # [m, R]: its LoRA's A x
            h = _gather_codes(first.quantize_input(args[0]), args[0].dtype, tokens, rt, low)
        else:
            h = gather_rows(args[0], tokens, rt.group, rt.stats, rt.scratch)  # [S_loc, D] -> [S, D]
        return (h, args[1].whole()) if self.whole_rope else (h,)


def _gather_codes(part: NVFP4Weight, dtype: torch.dtype, tokens: list[Span], rt: "ParallelRuntime", low: torch.Tensor | None = None) -> GatheredCodes:
    """Every rank's quantized rows, in rank order: one all-gather of [packed | scale bytes] per row
    (and the bytes of `low`, the rows' LoRA projection [m, R], where the linear has a branch)."""
    packed_width, scale_end = part.packed.shape[1], part.packed.shape[1] + part.scale.shape[1]
    extra = [] if low is None else [low.contiguous().view(torch.uint8)]
    local = torch.cat([part.packed, part.scale.view(torch.uint8), *extra], dim=1)  # [m, K/2 + K/16 (+ R * itemsize)] uint8
    whole = gather_rows(local, tokens, rt.group, rt.stats, rt.scratch)  # [S, K/2 + K/16 (+ ...)]
    codes = NVFP4Weight(whole[:, :packed_width], whole[:, packed_width:scale_end].view(torch.float8_e4m3fn), part.global_scale)
    return GatheredCodes(codes, dtype, None if low is None else whole[:, scale_end:].contiguous().view(low.dtype))


class _ReduceScatterBias:
    """Forward hook: sum the row-parallel partials, keep this rank's token rows, add the bias once.

    The bias is a buffer of the hooked module (`bias_name`), so it moves and is counted with it.
    """

    def __init__(self, runtime: "ParallelRuntime", bias_name: str):
        self.runtime = runtime
        self.bias_name = bias_name

    @outside_compiled  # a collective: outside any compiled region (h3core.model.compiled)
    def __call__(self, module: nn.Module, args: tuple, partial: torch.Tensor) -> torch.Tensor:
        rt = self.runtime
        tokens = rt.token_spans(partial.shape[0])  # the partial covers every row of the sequence
        out = reduce_scatter_rows(partial, tokens, rt.group, rt.stats, rt.scratch)  # [S, D] -> [S_loc, D]
        bias = getattr(module, self.bias_name)
        return out if bias is None else out + bias


def read_shard(weights: WeightSource, prefix: str, shards: TensorShards, linear: str, dtype: torch.dtype) -> tuple[nn.Module, torch.Tensor | None]:
    """This rank's shard of block linear `linear` (state-dict prefix `prefix`), checked against the
    plan's range, and the bias to add after the reduction (row-parallel only)."""
    if TENSOR_PARALLEL[linear] is Split.COLUMN:
        rows = shards.rows_of(linear)
        shard, bias = weights.linear(prefix, rows=rows), None
        held, want, what = shard.out_features, sum(len(s) for s in rows), "rows"
    else:
        columns = shards.columns_of(linear)
        name = f"{prefix}.bias"
        shard, bias = weights.linear(prefix, columns=columns), weights.tensor(name, dtype) if weights.has(name) else None
        held, want, what = shard.in_features, len(columns.elements), "columns"
    if held != want:  # a shard must hold exactly what the plan gave it (what `RankUsage.shards` records)
        raise RuntimeError(f"{prefix}: the shard read holds {held} {what}, the plan gives {want}")
    return shard, bias


def apply_tensor(model: H3Model, runtime: "ParallelRuntime", weights: WeightSource) -> H3Model:
    """Replace each block's `TENSOR_PARALLEL` linears by this rank's NVFP4 shards (ranges from the
    plan) and hook in the collectives around attention and MLP."""
    shards = runtime.plan.ranks[runtime.rank].tensor
    assert shards is not None, "a tensor-mode plan gives every rank its shards"
    dtype = model.dtype
    for i, block in enumerate(model.blocks):
        biases = {}
        for name in TENSOR_PARALLEL:
            parent, leaf = name.split(".")
            shard, biases[name] = read_shard(weights, f"blocks.{i}.{name}", shards, name, dtype)
            setattr(block.get_submodule(parent), leaf, shard)
            shard.tensor_cut = shards.cut_of(name)  # what is attached beside it later (a LoRA branch) is cut alike
        _hook_block(block, runtime, biases["attn.out_proj"], biases["mlp.fc2"])
    runtime.used.shards = shards
    runtime.used.heads = shards.heads(runtime.plan.head_dim)
    return model


def _hook_block(block: nn.Module, runtime: "ParallelRuntime", out_bias: torch.Tensor | None, fc2_bias: torch.Tensor | None) -> None:
    attn, mlp = block.attn, block.mlp
    attn.register_buffer("out_bias", out_bias)
    mlp.register_buffer("fc2_bias", fc2_bias)
    attn.register_forward_pre_hook(_GatherRows(runtime, whole_rope=True, linear="qkv_proj"))
    attn.register_forward_hook(_ReduceScatterBias(runtime, "out_bias"))
    mlp.register_forward_pre_hook(_GatherRows(runtime, whole_rope=False, linear="fc1"))
    mlp.register_forward_hook(_ReduceScatterBias(runtime, "fc2_bias"))
