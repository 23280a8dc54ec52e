"""What a task sees on one rank: `RankContext` (rank, world size, device, process group, progress),
and sub-groups of its first ranks (one World can run checks at several counts)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist


@dataclass
class RankContext:
    """One rank's view of a run, passed as the first argument of every task."""

    rank: int
    world_size: int
    local_rank: int
    device: "torch.device"
    group: "dist.ProcessGroup | None"  # None at world size 1 (collectives are then the identity)
    backend: str  # "gloo" | "nccl" | "none"
    progress: Callable[[Any], None] | None = field(default=None, repr=False, compare=False)

    @property
    def is_main(self) -> bool:
        """Rank 0: the rank that reports progress and whose view the caller renders."""
        return self.rank == 0

    def report(self, message: Any) -> None:
        """Send a (picklable, small) progress message to `World.on_progress`; rank 0 only, others no-op."""
        if self.rank == 0 and self.progress is not None:
            self.progress(message)

    def first_ranks(self, size: int) -> "RankContext | None":
        """This rank's context in a group of ranks `0..size-1` (None on the others).

        Lets one World run checks at several counts (2, 4, 6 ranks inside an 8-rank World).
        Creating a group is collective: every rank of `self.group` must call this, with the same
        sizes in the same order. Groups are created once per size and cached.
        """
        if size == self.world_size:
            return self
        if not 1 <= size <= self.world_size:
            raise ValueError(f"cannot take {size} ranks of a world of {self.world_size}")
        group = _first_ranks_group(self.group, size)
        if self.rank >= size:
            return None
        return replace(self, world_size=size, group=group if size > 1 else None, backend=self.backend if size > 1 else "none")


_SUBGROUPS: dict[tuple[int, int], Any] = {}


def _first_ranks_group(parent: "dist.ProcessGroup | None", size: int) -> "dist.ProcessGroup | None":
    import torch.distributed as dist

    key = (id(parent), size)
    if key not in _SUBGROUPS:
        _SUBGROUPS[key] = dist.new_group(ranks=list(range(size))) if size > 1 else None
    return _SUBGROUPS[key]


def leave_group() -> None:
    """Destroy this process's default group (and the cached sub-groups that die with it)."""
    import torch.distributed as dist

    _SUBGROUPS.clear()  # they die with the default group
    if dist.is_initialized():
        dist.destroy_process_group()
