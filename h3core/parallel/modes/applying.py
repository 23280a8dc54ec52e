"""How each mode is applied to a loaded model: `APPLY`, the one table `h3core.parallel.parallelize`
reads (the planning side of a mode is `h3core.parallel.modes.MODES`).

- Ulysses (`apply_ulysses`): every block's attention gets a `UlyssesProcessor` (q|k|v exchanged
  sequence->head and back around the kernel); weights untouched.
- tensor (`apply_tensor`): every block's `TENSOR_PARALLEL` linears become this rank's shards, read
  from a `WeightSource` (only their slices), with a row gather before and a reduce-scatter (+ bias
  once) after attention and MLP.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Mapping

from h3core.model.dit import H3Model
from h3core.nvfp4.io import WeightSource
from h3core.parallel.modes.contract import Mode
from h3core.parallel.modes.tensor import apply_tensor
from h3core.parallel.modes.ulysses import apply_ulysses

if TYPE_CHECKING:
    from h3core.parallel.runtime import ParallelRuntime

ApplyMode = Callable[[H3Model, "ParallelRuntime", WeightSource], H3Model]
"""Reshape a loaded model for a mode from outside (the model file knows no parallelism); `weights`
supplies the shards a mode reads."""


def _ulysses(model: H3Model, runtime: "ParallelRuntime", weights: WeightSource) -> H3Model:
    return apply_ulysses(model, runtime)  # replicated weights: nothing to read


APPLY: Mapping[Mode, ApplyMode] = {Mode.ULYSSES: _ulysses, Mode.TENSOR: apply_tensor}
