"""The rank layout: how a run's ranks form groups (torchtitan's `ParallelDims`, a DeviceMesh with named axes).

Three axes, outermost first:

- `replicas` (R): independent groups that each run whole requests (replica groups; sharing prompts
  out between them is the batch runner's job);
- `cfg` (1 or 2): with CFG parallel, the two halves of a replica, one per guidance branch: branch 0
  runs the prompt's sequence, branch 1 the negative prompt's, and one exchange per step gives every
  rank the other branch's velocity for its rows (`h3core.parallel.collectives.exchange_halves`);
- `degree` (N): the ranks that share one sequence in the chosen mode (Ulysses or tensor). The run's
  `ParallelPlan` describes one such group: heads, token spans, shards and weights of its N ranks.

`world = R x cfg x N`; global rank `(replica * cfg + branch) * N + local`. The degree axis is
innermost, so a group of N is on consecutive ranks (one machine under torchrun), and rank 0 is
local rank 0 of branch 0 of replica 0 (it encodes the prompts and gathers the result).

`RankGroups.create` makes the process groups of a layout on one rank: every sequence group (N
ranks) and every replica's pair of halves (2N ranks), created collectively on every rank of the
World in one fixed order and cached per World (`RankContext.subgroup`). A layout of one group has
no group to create: its sequence group is the run's own group (None at one rank, the identity).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, computed_field

from h3core.errors import LayoutError

if TYPE_CHECKING:
    from h3core.runtime.context import RankContext

SEQUENCE_NAMES = ("prompt", "negative prompt")
"""The packed sequences of a run, in order: the prompt's, and guidance's negative prompt's."""

CFG_NEEDS_GUIDANCE = "--cfg-parallel needs guidance: give --guidance > 1 (and optionally --negative-prompt)"


class RankCoords(BaseModel):
    """Where one global rank sits in the layout."""

    model_config = ConfigDict(frozen=True)
    replica: int
    branch: int = Field(description="CFG half: 0 runs the prompt's sequence, 1 the negative prompt's (always 0 without CFG parallel).")
    local: int = Field(description="Rank within its group of `degree` ranks: the index into the plan's spans and shards.")


class RankGroup(BaseModel):
    """One group of `degree` ranks that share a sequence, and what it runs each step."""

    model_config = ConfigDict(frozen=True)
    replica: int
    branch: int
    ranks: list[int] = Field(description="Global ranks, in local-rank order.")
    runs: list[str] = Field(description="The packed sequences it runs every step, in order ('prompt', 'negative prompt').")


class RankLayout(BaseModel):
    """replicas x cfg x degree ranks (module docstring); validated by `of`."""

    model_config = ConfigDict(frozen=True)
    replicas: int = Field(1, ge=1, description="Replica groups: independent groups of cfg x degree ranks.")
    cfg: int = Field(1, ge=1, le=2, description="2 with CFG parallel (a half per guidance branch), else 1.")
    degree: int = Field(ge=1, description="Ranks that share one sequence in the chosen mode: the plan's ranks.")
    guided: bool = Field(False, description="Guidance is on: every step runs the prompt's and the negative prompt's sequence.")

    @classmethod
    def of(cls, world_size: int, *, cfg_parallel: bool = False, replicas: int = 1, guided: bool = False) -> "RankLayout":
        """The layout of `world_size` ranks; raises `LayoutError` (one line) where it cannot apply."""
        if cfg_parallel and not guided:
            raise LayoutError(CFG_NEEDS_GUIDANCE)
        cfg = 2 if cfg_parallel else 1
        if replicas < 1:
            raise LayoutError(f"--replicas must be at least 1, got {replicas}")
        if world_size % (replicas * cfg):
            raise LayoutError(_indivisible(world_size, replicas, cfg))
        return cls(replicas=replicas, cfg=cfg, degree=world_size // (replicas * cfg), guided=guided)

    @computed_field  # type: ignore[prop-decorator]
    @property
    def world_size(self) -> int:
        return self.replicas * self.cfg * self.degree

    @property
    def cfg_parallel(self) -> bool:
        return self.cfg == 2

    def coords(self, rank: int) -> RankCoords:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is not in a layout of {self.world_size} ranks")
        group, local = divmod(rank, self.degree)
        replica, branch = divmod(group, self.cfg)
        return RankCoords(replica=replica, branch=branch, local=local)

    def rank_of(self, replica: int, branch: int, local: int) -> int:
        return (replica * self.cfg + branch) * self.degree + local

    def sequence_ranks(self) -> list[list[int]]:
        """Every group of `degree` ranks, in rank order (replica-major, then branch)."""
        n = self.degree
        return [list(range(g * n, (g + 1) * n)) for g in range(self.replicas * self.cfg)]

    def cfg_ranks(self) -> list[list[int]]:
        """Per replica, the ranks of both CFG halves (branch 0's, then branch 1's); empty without CFG parallel."""
        width = self.cfg * self.degree
        return [list(range(r * width, (r + 1) * width)) for r in range(self.replicas)] if self.cfg_parallel else []

    def runs(self, branch: int) -> list[str]:
        """The sequences a group of `branch` runs each step."""
        if self.cfg_parallel:
            return [SEQUENCE_NAMES[branch]]
        return list(SEQUENCE_NAMES[: 2 if self.guided else 1])

    @computed_field  # type: ignore[prop-decorator]
    @property
    def groups(self) -> list[RankGroup]:
        """Every group: its replica, branch, global ranks and what it runs."""
        return [
            RankGroup(replica=g // self.cfg, branch=g % self.cfg, ranks=ranks, runs=self.runs(g % self.cfg))
            for g, ranks in enumerate(self.sequence_ranks())
        ]

    def describe(self) -> str:
        """One line: 'world 8 = 1 replica x 2 CFG halves x 4 ranks per sequence'."""
        halves = " x 2 CFG halves" if self.cfg_parallel else ""
        plural = "s" if self.replicas > 1 else ""
        return f"world {self.world_size} = {self.replicas} replica{plural}{halves} x {self.degree} rank{'s' if self.degree > 1 else ''} per sequence"


def _indivisible(world_size: int, replicas: int, cfg: int) -> str:
    if replicas == 1:
        return (f"--cfg-parallel splits the ranks into two halves, one per guidance branch, and {world_size} is odd: "
                "give an even rank count")
    halves = " of two CFG halves each" if cfg == 2 else ""
    return f"{world_size} ranks do not split into {replicas} replica groups{halves}: give a multiple of {replicas * cfg} ranks"


@dataclass(frozen=True)
class CfgHalf:
    """CFG parallel on one rank: its branch (0: the prompt's sequence, 1: the negative prompt's) and
    the process group of both halves of its replica (2N ranks: branch 0's, then branch 1's)."""

    branch: int
    group: Any  # dist.ProcessGroup


@dataclass(frozen=True)
class RankGroups:
    """One rank's place in a layout and its process groups (None where a group is a single rank)."""

    layout: RankLayout
    coords: RankCoords
    sequence: Any  # dist.ProcessGroup | None: the `degree` ranks that share this rank's sequence
    halves: Any  # dist.ProcessGroup | None: both CFG halves of this rank's replica (None without CFG parallel)

    @classmethod
    def create(cls, ctx: "RankContext", layout: RankLayout) -> "RankGroups | None":
        """Every group of `layout`, laid over the first `layout.world_size` ranks of `ctx`; this rank's
        (None for a rank of `ctx` outside the layout).

        Collective over the whole World (`RankContext.subgroup`): every rank creates every group, in
        one order, also the groups it is not in; groups are cached, so a second call creates nothing.
        """
        if layout.world_size > ctx.world_size:
            raise ValueError(f"a layout of {layout.world_size} ranks does not fit a world of {ctx.world_size}")
        sequence = [ctx.subgroup(ranks) for ranks in layout.sequence_ranks()]
        halves = [ctx.subgroup(ranks) for ranks in layout.cfg_ranks()]
        if ctx.rank >= layout.world_size:
            return None
        c = layout.coords(ctx.rank)
        return cls(layout, c, sequence[c.replica * layout.cfg + c.branch], halves[c.replica] if halves else None)

    @property
    def cfg_half(self) -> CfgHalf | None:
        return CfgHalf(self.coords.branch, self.halves) if self.layout.cfg_parallel else None

    @property
    def leads_replica(self) -> bool:
        """Local rank 0 of branch 0: the rank that holds its replica's whole result after the gather."""
        return self.coords.branch == 0 and self.coords.local == 0
