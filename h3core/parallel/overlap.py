"""Ulysses overlap (`--ulysses-overlap auto|on|off`): whether each block's two all-to-alls travel in
head groups while attention runs, and in how many.

Overlapped (`h3core.parallel.modes.ulysses.attend_in_groups`), a block's seq->head all-to-all is
split into `groups` narrower ones by head (`partition.head_groups`), started one after the other
as their q|k|v are written; attention on group g runs while g+1.. are in flight, and the return of
g travels while g+1's attention runs. The outputs are bitwise those of the whole all-to-all (every
head meets the same values in the same kernel); only the time changes, and only where the
transport runs beside the computation instead of taking its cores.

`choose` decides: `on` and `off` force it; `auto` turns it on only for a transport where it has
measured faster (`MEASURED_FASTER`, by `h3 bench-transport N --overlap-groups G`, which times both
paths alternately in one run):

- Gloo (the CPU): off. Gloo's transport threads copy on the same cores the attention computes on,
  so little is hidden: on this project's 2-core machine (shared, loaded), overlapped / whole = 0.99
  at 2 ranks and 1.02 at 4 (medians of 11 per-iteration ratios; docs/overlap.md).
- NCCL (CUDA): off until measured: the collectives run on their own stream, which is where overlap
  pays (xDiT, yunchang), but no multi-GPU machine has timed it here yet. `--ulysses-overlap on`
  runs it; `h3 bench-transport N --overlap-groups G` measures it.

One rank, or tensor mode: nothing to overlap (no record).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

OverlapChoice = Literal["auto", "on", "off"]
CHOICES: tuple[str, ...] = ("auto", "on", "off")

GROUPS = 2
"""Head groups per all-to-all when overlapped (capped at the fewest heads a rank holds): the first
group's all-to-all and the last one's return stay exposed, about 1/GROUPS of each; more groups
send smaller messages."""

MEASURED_FASTER: dict[str, bool] = {"gloo": False, "nccl": False}
"""Per process-group backend: did overlap measure faster than the whole all-to-all (module docstring)."""


class UlyssesOverlap(BaseModel):
    """The plan's record of Ulysses overlap: the head groups of each all-to-all, and why."""

    groups: int = Field(ge=1, description="Head groups each all-to-all is split into (1: one whole all-to-all each way, not overlapped).")
    reason: str = Field(description="Why overlapped or not.")

    @property
    def on(self) -> bool:
        return self.groups > 1


def backend_of(device: str) -> str:
    """The process-group backend a run's ranks use on `device` ('cuda' or 'cpu')."""
    return "nccl" if device == "cuda" else "gloo"


def choose(choice: str, *, backend: str, heads_per_rank: list[int], groups: int = GROUPS) -> UlyssesOverlap:
    """The overlap of a Ulysses group of `len(heads_per_rank)` ranks on `backend` for `choice`."""
    count = max(1, min(groups, *heads_per_rank))
    if len(heads_per_rank) == 1:
        return UlyssesOverlap(groups=1, reason="one rank: no all-to-all")
    if choice == "off":
        return UlyssesOverlap(groups=1, reason="turned off (--ulysses-overlap off)")
    if count == 1:
        return UlyssesOverlap(groups=1, reason="a rank holds one head: nothing to split")
    if choice == "on":
        return UlyssesOverlap(groups=count, reason=f"asked for (--ulysses-overlap on): {count} head groups")
    if MEASURED_FASTER.get(backend, False):
        return UlyssesOverlap(groups=count, reason=f"auto: measured faster on {backend}: {count} head groups")
    return UlyssesOverlap(groups=1, reason=f"auto: not measured faster on {backend} (h3core.parallel.overlap); --ulysses-overlap on to run it")
