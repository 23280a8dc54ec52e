"""NVFP4 tensor parallelism on token-sharded blocks (DESIGN.md §5): the `tensor` mode.

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

from pydantic import BaseModel, ConfigDict, Field

from h3core.lora.tensor import follow_tensor_split
from h3core.model.dit import TENSOR_PARALLEL, H3Model, Split
from h3core.nvfp4.io import WeightSource
from h3core.nvfp4.layout import ColumnSlice
from h3core.nvfp4.codec import NVFP4Weight
from h3core.nvfp4.linear import DenseLinear, GatheredCodes, NVFP4Linear
from h3core.nvfp4.matmul import FP4_PATHS
from h3core.nvfp4.shard import column_parallel, row_parallel
from h3core.parallel import partition
from h3core.parallel.collectives import gather_rows, reduce_scatter_rows
from h3core.parallel.modes.registry import Mode, ParallelMode, register
from h3core.span import Span


class TensorShards(BaseModel):
    """What one rank holds of each block's linears in tensor mode (`h3core.model.dit.TENSOR_PARALLEL`)."""

    model_config = ConfigDict(frozen=True)
    qkv_rows: list[Span] = Field(description="Rows of the stacked [q | k | v] weight, one span per third (this rank's heads).")
    attn_out_columns: ColumnSlice = Field(description="Input columns of out_proj (this rank's heads x head_dim).")
    fc1_rows: list[Span] = Field(description="Rows of the fused [gate | up] fc1 weight: the gate span, then the up span.")
    fc2_columns: ColumnSlice = Field(description="Input columns of fc2: the same feature range as fc1's rows, in whole NVFP4 blocks.")

    def of(self, linear: str) -> list[Span] | ColumnSlice:
        """The range of block linear `linear` ('attn.qkv_proj', 'attn.out_proj', 'mlp.fc1', 'mlp.fc2')."""
        return {"attn.qkv_proj": self.qkv_rows, "attn.out_proj": self.attn_out_columns, "mlp.fc1": self.fc1_rows, "mlp.fc2": self.fc2_columns}[linear]


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

    def __init__(self, runtime: "ParallelRuntime", whole_rope: bool, linear: str):  # noqa: F821 - h3core.parallel.runtime
        self.runtime = runtime
        self.whole_rope = whole_rope
        self.linear = linear

    def __call__(self, module: nn.Module, args: tuple) -> tuple:
        rt = self.runtime
        first = module.get_submodule(self.linear)
        if QUANTIZE_BEFORE_GATHER and isinstance(first, NVFP4Linear) and first.path in FP4_PATHS:
            low = first.lora.project(args[0].reshape(-1, first.in_features)) if first.lora is not None else None  # [m, R]: its LoRA's A x
            h = _gather_codes(first.quantize_input(args[0]), args[0].dtype, rt, low)
        else:
            h = gather_rows(args[0], rt.tokens, rt.group, rt.stats)  # [S_loc, D] -> [S, D]
        return (h, args[1].whole()) if self.whole_rope else (h,)


def _gather_codes(part: NVFP4Weight, dtype: torch.dtype, rt: "ParallelRuntime", low: torch.Tensor | None = None) -> GatheredCodes:  # noqa: F821
    """Every rank's quantized rows, in rank order: one all-gather of [packed | scale bytes] per row
    (and the bytes of `low`, the rows' LoRA projection [m, R], where the linear has a branch)."""
    packed_width, scale_end = part.packed.shape[1], part.packed.shape[1] + part.scale.shape[1]
    extra = [] if low is None else [low.contiguous().view(torch.uint8)]
    local = torch.cat([part.packed, part.scale.view(torch.uint8), *extra], dim=1)  # [m, K/2 + K/16 (+ R * itemsize)] uint8
    whole = gather_rows(local, rt.tokens, rt.group, rt.stats)  # [S, K/2 + K/16 (+ ...)]
    codes = NVFP4Weight(whole[:, :packed_width], whole[:, packed_width:scale_end].view(torch.float8_e4m3fn), part.global_scale)
    return GatheredCodes(codes, dtype, None if low is None else whole[:, scale_end:].contiguous().view(low.dtype))


class _ReduceScatterBias:
    """Forward hook: sum the row-parallel partials, keep this rank's token rows, add the bias once.

    The bias is a buffer of the hooked module (`bias_name`), so it moves and is counted with it.
    """

    def __init__(self, runtime: "ParallelRuntime", bias_name: str):  # noqa: F821
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


def apply_tensor(model: H3Model, runtime: "ParallelRuntime", weights: WeightSource) -> H3Model:  # noqa: F821
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
            follow_tensor_split(shard, split, part)  # a LoRA branch attached to it is cut alike (h3core.lora.tensor)
        _hook_block(block, runtime, biases["attn.out_proj"], biases["mlp.fc2"])
    q_rows = shards.qkv_rows[0]  # the q third: this rank's heads x head_dim
    runtime.used.shards = shards
    runtime.used.heads = Span(q_rows.start // runtime.plan.head_dim, q_rows.stop // runtime.plan.head_dim)
    return model


def _hook_block(block: nn.Module, runtime: "ParallelRuntime", out_bias: torch.Tensor | None, fc2_bias: torch.Tensor | None) -> None:  # noqa: F821
    attn, mlp = block.attn, block.mlp
    attn.register_buffer("out_bias", out_bias)
    mlp.register_buffer("fc2_bias", fc2_bias)
    attn.register_forward_pre_hook(_GatherRows(runtime, whole_rope=True, linear="qkv_proj"))
    attn.register_forward_hook(_ReduceScatterBias(runtime, "out_bias"))
    mlp.register_forward_pre_hook(_GatherRows(runtime, whole_rope=False, linear="fc1"))
    mlp.register_forward_hook(_ReduceScatterBias(runtime, "fc2_bias"))


# --- the mode ----------------------------------------------------------------------------------------------


def _tensor_shards(config, heads: list[Span]) -> list[TensorShards]:  # type: ignore[no-untyped-def]
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


def _shard_bytes(spec, shards: TensorShards, config) -> int:  # type: ignore[no-untyped-def]
    """Bytes of one block-linear tensor a rank holds: its rows (column-parallel) or columns (row-parallel)
    as a share of the whole; 0-dim scales and markers whole."""
    linear = spec.prefix.split(".", 2)[2]  # blocks.<i>.<linear>
    if len(spec.shape) == 0 or spec.name.endswith(".comfy_quant"):
        return spec.nbytes
    part = shards.of(linear)
    if TENSOR_PARALLEL[linear] is Split.COLUMN:
        rows = {"attn.qkv_proj": 3 * config.attention_width, "mlp.fc1": 2 * config.ffn_dim}[linear]
        return spec.nbytes * sum(len(s) for s in part) // rows  # type: ignore[union-attr]
    if spec.name.endswith(".bias"):
        return spec.nbytes
    width = {"attn.out_proj": config.attention_width, "mlp.fc2": config.ffn_dim}[linear]
    return spec.nbytes * len(part.elements) // width  # type: ignore[union-attr]


def _columns(c: ColumnSlice) -> str:
    return f"{c.elements} · {c.packed_bytes} · {c.scale_columns}"


class TensorMode(ParallelMode):
    """Token rows per rank between blocks; inside, each rank's heads and fc range of the block linears."""

    name = "tensor"
    summary = "block linears split by heads and NVFP4 blocks (1/N each), rows gathered and partials reduce-scattered per block"

    def shards(self, config, heads):  # type: ignore[no-untyped-def]
        return _tensor_shards(config, list(heads))

    def weights_per_rank(self, specs, ranks, config):  # type: ignore[no-untyped-def]
        split = tuple(f"blocks.{i}.{name}." for i in range(config.num_blocks) for name in TENSOR_PARALLEL)
        block = [s for s in specs if s.name.startswith(split)]
        total, dense16 = sum(s.nbytes for s in specs), sum(s.nbytes for s in specs if s.dtype in ("BF16", "F16"))
        out = []
        for rank in ranks:
            held = [_shard_bytes(s, rank.tensor, config) for s in block]
            block16 = [(h, s) for h, s in zip(held, block) if s.dtype in ("BF16", "F16")]
            out.append((total - sum(s.nbytes for s in block) + sum(held),
                        dense16 - sum(s.nbytes for _, s in block16) + sum(h for h, _ in block16)))
        return out

    def plan_tables(self, plan):  # type: ignore[no-untyped-def]
        rows = [[str(r.rank), " | ".join(map(str, r.tensor.qkv_rows)), _columns(r.tensor.attn_out_columns),
                 " | ".join(map(str, r.tensor.fc1_rows)), _columns(r.tensor.fc2_columns)] for r in plan.ranks]
        title = "shards per block (rows of column-parallel weights; input columns as elements · packed bytes · scale columns)"
        return [(title, ["rank", "qkv_proj rows q | k | v", "out_proj columns", "fc1 rows gate | up", "fc2 columns"], rows)]

    def activation_elements(self, config, plan, tokens):  # type: ignore[no-untyped-def]
        s, s_loc, h_loc, n = tokens, max(len(t) for seq in plan.sequences for t in seq.tokens), max(plan.heads), plan.world_size
        d, dh, f = config.hidden, config.head_dim, config.ffn_dim
        x = 2 * s_loc * d  # the residual stream rows and their modulated copy, alive through the block
        gathered = s * d if n > 1 else 0  # the all-gathered sequence (one rank: the identity, no copy)
        attn = x + gathered + s * 3 * h_loc * dh + s * h_loc * dh + s * d  # + q|k|v of its heads, their output, the partial
        mlp = x + gathered + s * 3 * -(-f // n) + s * d  # + its fc1 rows' output [S, 2F/N] and activation [S, F/N], the partial
        return max(attn, mlp)

    def rounding_ulps(self, dtype):  # type: ignore[no-untyped-def]
        # fp32 on this project's CPU: row-parallel partials summed in another order than one GEMM, up to
        # 5.25 eps; 16-bit: each partial rounded, the fp32 sum rounded once (0.99 units measured).
        return 6.0 if dtype.itemsize == 4 else 1.0

    def left_out_at_load(self, num_blocks):  # type: ignore[no-untyped-def]
        return tuple(f"blocks.{i}.{name}." for i in range(num_blocks) for name in TENSOR_PARALLEL)

    def apply(self, model, runtime, weights):  # type: ignore[no-untyped-def]
        apply_tensor(model, runtime, weights)

    def input_split_linears(self, model):  # type: ignore[no-untyped-def]
        # the row-parallel ones see their columns of the whole rows; qkv_proj and fc1 quantize their
        # rank's rows before the gather (`_GatherRows`): all four agree one scale over the group
        return block_linears(model)


Mode.TENSOR = Mode(register(TensorMode()).name)
