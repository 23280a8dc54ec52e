"""`parallelize`: the one entry that applies a plan's mode to a loaded model, in a fixed order.

As torchtitan's `parallelize_*` functions: the model is built and loaded without knowing it will be
parallel (tensor mode leaves out the linears it will read as shards: `left_out_at_load`), then

1. the mode is applied (`ParallelMode.apply`, `h3core.parallel.modes`): tensor mode makes each
   block's `TENSOR_PARALLEL` linears this rank's shards, read from a `WeightSource` (only their
   slices), with a row gather before and a reduce-scatter (+ bias once) after attention and MLP;
   Ulysses mode makes each block's attention core exchange q|k|v sequence->head and back;
2. NVFP4 linears whose input the mode's ranks split agree on one activation scale (the fp4 paths);
3. every forward checks that the rows it is fed are this rank's token span of the sequence
   being run (and records them).

The order matters: (2) must see the final modules (tensor mode's shards replace linears), and (3)
is the model's outermost hook. Every forward then runs inside `runtime.sequence(...)`. A plan at
world size 1 applies the same steps: they are the identity there, bit for bit. The unparallelised
baseline (what the distributed layer costs at one rank) is the model loaded without this call.
"""

from __future__ import annotations

from h3core.model.dit import H3Model
from h3core.nvfp4.io import WeightSource
from h3core.parallel.modes import mode_of
from h3core.parallel.plan import ParallelPlan
from h3core.parallel.runtime import ParallelRuntime


def left_out_at_load(plan: ParallelPlan, num_blocks: int) -> tuple[str, ...]:
    """State-dict prefixes the loader leaves out because the plan's mode reads them as shards."""
    return mode_of(plan.mode).left_out_at_load(num_blocks)


def parallelize(model: H3Model, runtime: ParallelRuntime, weights: WeightSource) -> H3Model:
    """Apply `runtime.plan`'s mode to `model` in the order of the module docstring; `weights` supplies
    the shards a mode reads (tensor mode's)."""
    mode = mode_of(runtime.plan.mode)
    mode.apply(model, runtime, weights)
    runtime.agree_activation_scales(mode.input_split_linears(model))
    runtime.guard_rows(model)
    return model
