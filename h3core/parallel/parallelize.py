"""`parallelize`: the one entry that applies a plan's mode to a loaded model, in a fixed order.

As torchtitan's `parallelize_*` functions: the model is built and loaded without knowing it will be
parallel (tensor mode leaves out the linears it will read as shards: `left_out_at_load`, the mode's
planning), then

1. the mode is applied (`h3core.parallel.modes.applying.APPLY`: `apply_ulysses` swaps every block's
   attention processor for Ulysses' exchange of q|k|v sequence->head and back; `apply_tensor` makes
   each block's `TENSOR_PARALLEL` linears this rank's shards, read from a `WeightSource` (only their
   slices), with a row gather before and a reduce-scatter (+ bias once) after attention and MLP);
2. NVFP4 linears whose input the ranks split (every block's four, in both modes: `block_linears`)
   agree on one activation scale (the fp4 paths);
3. every forward checks that the rows it is fed are this rank's token span of the sequence it is
   given, and holds that sequence's spans for the hooks of that forward (`ParallelRuntime.guard_rows`).

The order matters: (2) must see the final modules (tensor mode's shards replace linears), and (3)
is the model's outermost hook. A plan at world size 1 applies the same steps: they are the
identity there, bit for bit. The unparallelised baseline (what the distributed layer costs at one
rank) is the model loaded without this call.
"""

from __future__ import annotations

from h3core.model.dit import H3Model
from h3core.nvfp4.io import WeightSource
from h3core.parallel.modes import mode_of
from h3core.parallel.modes.applying import APPLY
from h3core.parallel.modes.tensor import block_linears
from h3core.parallel.plan import ParallelPlan
from h3core.parallel.runtime import ParallelRuntime


def left_out_at_load(plan: ParallelPlan, num_blocks: int) -> tuple[str, ...]:
    """State-dict prefixes the loader leaves out because the plan's mode reads them as shards."""
    return mode_of(plan.mode).left_out_at_load(num_blocks)


def parallelize(model: H3Model, runtime: ParallelRuntime, weights: WeightSource) -> H3Model:
    """Apply `runtime.plan`'s mode to `model` in the order of the module docstring; `weights` supplies
    the shards a mode reads (tensor mode's)."""
    APPLY[runtime.plan.mode](model, runtime, weights)
    runtime.agree_activation_scales(block_linears(model))
    runtime.guard_rows(model)
    return model
