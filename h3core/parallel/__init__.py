"""The two distributed modes, applied to a finished model from outside (the model file has no parallelism).

Order of application (both modes):
1. the model is built and loaded (tensor mode: the per-block linears are left out and read as shards);
2. `apply_ulysses` / `apply_tensor` swap or shard modules and register hooks;
3. every forward runs inside `runtime.sequence(token_spans)`, which tells the wrappers how the
   packed sequence being processed is split over ranks.
"""

from h3core.parallel.runtime import ParallelRuntime
from h3core.parallel.tensor import CheckpointWeights, ModelWeights, apply_tensor
from h3core.parallel.ulysses import apply_ulysses

__all__ = ["ParallelRuntime", "apply_ulysses", "apply_tensor", "CheckpointWeights", "ModelWeights"]
