"""What a task sees on one rank: `RankContext` (rank, world size, device, process group, progress),
sub-groups of its first ranks (one World can run checks at several counts), and process groups of
any list of its ranks (`subgroup`: the groups of a rank layout, `h3core.parallel.layout`)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable, Iterable

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
    groups: dict[tuple[int, ...], Any] = field(default_factory=dict, repr=False, compare=False)
    """The process groups made of this World's ranks, by global ranks (`subgroup`): created once,
    shared by every context derived from this one (`first_ranks` keeps the same dict)."""
    held: dict[Any, Any] = field(default_factory=dict, repr=False, compare=False)
    """What this rank keeps between tasks of one World (`h3core.generate.resident`'s loaded pipeline)."""
    store: Any = field(default=None, repr=False, compare=False)
    """The World's key-value store (`torch.distributed.Store`: the rendezvous TCP store of spawned and
    torchrun ranks, an in-process `HashStore` at world size 1), which every rank and the launching
    process reach: small control values that must not wait for a task to end (a serving job's
    cancel flag and step progress, `h3core.serve.board`)."""

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
        group = self.subgroup(range(size))
        if self.rank >= size:
            return None
        return replace(self, world_size=size, group=group, backend=self.backend if size > 1 else "none")

    def subgroup(self, ranks: Iterable[int]) -> "dist.ProcessGroup | None":
        """The process group of `ranks` (ranks of this context, ascending): None for a single rank,
        this context's own group for all of its ranks.

        Creating a group is collective over the whole World: every process of it must call this
        for the same rank lists in the same order, also those not in the list (as `first_ranks`
        does). Groups are cached per World by their global ranks, so a group created once on every
        process (e.g. on the World's 8 ranks before taking `first_ranks(6)`) is found again, with no
        collective, by a sub-context of fewer ranks.
        """
        ranks = list(ranks)
        if len(ranks) <= 1:
            return None
        if ranks == list(range(self.world_size)):
            return self.group
        if ranks[-1] >= self.world_size or ranks != sorted(set(ranks)):
            raise ValueError(f"ranks {ranks} are not distinct ranks of a world of {self.world_size}, ascending")
        return self._group_of(tuple(_global_rank(self.group, r) for r in ranks))

    def _group_of(self, global_ranks: tuple[int, ...]) -> "dist.ProcessGroup":
        import torch.distributed as dist

        if global_ranks not in self.groups:
            self.groups[global_ranks] = dist.new_group(ranks=list(global_ranks))
        return self.groups[global_ranks]

    def leave(self) -> None:
        """Forget what this rank held and the sub-groups (they die with the default group)."""
        self.held.clear()
        self.groups.clear()


def _global_rank(group: "dist.ProcessGroup | None", rank: int) -> int:
    import torch.distributed as dist

    return rank if group is None or group is dist.group.WORLD else dist.get_global_rank(group, rank)


def leave_group(ctx: RankContext | None = None) -> None:
    """Destroy this process's default group (and `ctx`'s cached sub-groups, which die with it)."""
    import torch.distributed as dist

    if ctx is not None:
        ctx.leave()
    if dist.is_initialized():
        dist.destroy_process_group()
