"""The distributed modes: an `Enum` of their names (`Mode`), one planning object per mode (`MODES`,
each a `ParallelMode`), and, apart from them, the functions that apply a mode to a loaded model
(`h3core.parallel.modes.applying`: `apply_ulysses`, `apply_tensor`).

| module | what | torch |
|---|---|---|
| `modes` (this one) | `Mode`, the `ParallelMode` protocol, `MODES`, `mode_of` | no |
| `modes.ulysses_plan` | Ulysses' planning: whole replicas, its activation memory and rounding | no |
| `modes.tensor_plan` | tensor mode's planning: which block linears split and how (`TENSOR_PARALLEL`), each rank's `TensorShards`, bytes held | no |
| `modes.ulysses` | `apply_ulysses`: the attention processor that exchanges q, k, v sequence->head and back | yes |
| `modes.tensor` | `apply_tensor`: the shards read, the gather / reduce-scatter hooks | yes |
| `modes.applying` | `APPLY`: which function applies which mode (what `h3core.parallel.parallelize` calls) | yes |

A mode's planning object owns everything about it that the launcher needs before any rank exists
(torch-free, so `h3 plan` and the memory check run without torch's weight):

| what | method |
|---|---|
| the per-rank shards the plan records (and `h3 plan` prints) | `shards`, `plan_tables` |
| the checkpoint bytes each rank holds | `weights_per_rank` |
| what the loader leaves out because the mode reads it as shards | `left_out_at_load` |
| one block's activation working set on the largest rank | `activation_elements` |
| how far one linear computed its way is from one rank's, in eps (the parity bound) | `rounding_ulps` |

Adding a mode: a name in `Mode`, its planning object in `MODES`, its apply function in `APPLY`;
nothing else branches on a mode's name (tests/unit/test_modes.py checks all three tables agree).
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Mapping

from h3core.parallel.modes.contract import BlockShape, Mode, ParallelMode, PlanTable
from h3core.parallel.modes.tensor_plan import TensorPlanning
from h3core.parallel.modes.ulysses_plan import UlyssesPlanning

MODES: Mapping[Mode, ParallelMode] = MappingProxyType({Mode.ULYSSES: UlyssesPlanning(), Mode.TENSOR: TensorPlanning()})
"""Every mode's planning object, by name (read-only)."""


def mode_of(name: object) -> ParallelMode:
    """The planning object of a mode (a `Mode`, or its name)."""
    return MODES[Mode(name)]


__all__ = ["MODES", "BlockShape", "Mode", "ParallelMode", "PlanTable", "mode_of"]
