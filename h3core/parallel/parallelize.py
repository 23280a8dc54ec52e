"""`parallelize`: the one entry that applies a plan's mode to a loaded model, in a fixed order.

As torchtitan's `parallelize_*` functions: the model is built and loaded without knowing it will be
parallel (tensor mode leaves out the linears it will read as shards: `left_out_at_load`), then

1. tensor mode: each block's `TENSOR_PARALLEL` linears become this rank's NVFP4 shards, read from a
   `WeightSource` (only their slices), with a row gather before and a reduce-scatter (+ bias once)
   after attention and MLP (`apply_tensor`);
2. Ulysses mode: each block's attention core exchanges q|k|v sequence->head and back (`apply_ulysses`);
3. both: NVFP4 linears whose input the ranks split agree on one activation scale (the fp4 paths);
4. both: every forward checks that the rows it is fed are this rank's token span of the sequence
   being run (and records them).

The order matters: (3) must see the final modules (tensor mode's shards replace linears), and (4)
is the model's outermost hook. Every forward then runs inside `runtime.sequence(...)`. A plan at
world size 1 applies the same steps: they are the identity there, bit for bit. The unparallelised
baseline (what the distributed layer costs at one rank) is the model loaded without this call.
"""

from __future__ import annotations

import torch.nn as nn

from h3core.model.dit import TENSOR_PARALLEL, H3Model, Split, tensor_parallel_prefixes
from h3core.nvfp4.io import WeightSource
from h3core.parallel.plan import Mode, ParallelPlan
from h3core.parallel.runtime import ParallelRuntime
from h3core.parallel.tensor import apply_tensor
from h3core.parallel.ulysses import apply_ulysses


def left_out_at_load(plan: ParallelPlan, num_blocks: int) -> tuple[str, ...]:
    """State-dict prefixes the loader leaves out because `parallelize` reads them as shards."""
    return tensor_parallel_prefixes(num_blocks) if plan.mode is Mode.TENSOR else ()


def parallelize(model: H3Model, runtime: ParallelRuntime, weights: WeightSource) -> H3Model:
    """Apply `runtime.plan`'s mode to `model` in the order of the module docstring; `weights` supplies
    tensor mode's shards (unused in Ulysses mode)."""
    mode = runtime.plan.mode
    if mode is Mode.TENSOR:
        apply_tensor(model, runtime, weights)
    else:
        apply_ulysses(model, runtime)
    runtime.agree_activation_scales(_input_split_linears(model, mode))
    runtime.guard_rows(model)
    return model


def _input_split_linears(model: H3Model, mode: Mode) -> list[nn.Module]:
    """The block linears whose input the ranks split. Ulysses: all four (each sees its rows only).
    Tensor mode: the row-parallel ones (their columns of the full rows); qkv_proj and fc1 see gathered
    full rows. The rest (input projections, token refiner, AdaLN) see whole, replicated inputs."""
    names = [name for name, split in TENSOR_PARALLEL.items() if mode is Mode.ULYSSES or split is Split.ROW]
    return [block.get_submodule(name) for block in model.blocks for name in names]
