"""One World shared by every check of an `h3 verify` run, and the two ways checks use it.

- At a rank count: every rank of the World runs the same task; `ctx.first_ranks(count)` (collective,
  same order on every rank) gives ranks `0..count-1` their sub-group and the others nothing to do.
  Each rank of the sub-group computes its share with the real distributed code *and* the
  single-rank reference of the same inputs (group=None, in the same process, so at the same CPU
  thread count), and returns `Measure`s; they are combined into rows here.
- Side by side: single-rank jobs (the end-to-end reference, the other mode at one rank, other attention
  backends) run on separate ranks of the World at the same time, each as a world of one
  (`as_world_of_one(ctx)`), so the reference shares the ranks' device, thread count and process setup.

Counts the device cannot hold (CUDA: more ranks than visible GPUs) never reach the World: their
rows are skipped with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

from h3core.runtime.context import RankContext
from h3core.runtime.world import World
from h3core.verify.rows import CheckRow, Measure, combine, skipped
from h3core.verify.spec import VerifySpec

RankMeasure = Callable[[RankContext, VerifySpec], list[Measure]]
"""A check's rank-side function: this rank's measures (same variants, same order on every rank)."""


def as_world_of_one(ctx: RankContext) -> RankContext:
    """This rank as a world of one: no group, collectives are the identity, it counts as rank 0."""
    return replace(ctx, rank=0, world_size=1, group=None, backend="none", progress=ctx.progress if ctx.rank == 0 else None)


def measure_on_first_ranks(ctx: RankContext, fn: RankMeasure, count: int, spec: VerifySpec) -> list[Measure] | None:
    """World task: `fn` on ranks `0..count-1` as a group of `count` (None on the other ranks)."""
    sub = ctx.first_ranks(count)
    return None if sub is None else fn(sub, spec)


def jobs_on_own_ranks(ctx: RankContext, jobs: Sequence[tuple[Callable[..., Any], tuple] | None]) -> Any:
    """World task: rank `r` runs `jobs[r]` (a module-level function and its arguments) as a world of one."""
    job = jobs[ctx.rank] if ctx.rank < len(jobs) else None
    if job is None:
        return None
    fn, args = job
    return fn(as_world_of_one(ctx), *args)


@dataclass
class Session:
    """The World, the spec and the counts every check of one run shares."""

    world: World
    spec: VerifySpec
    counts: list[int]
    """Rank counts asked for, ascending."""
    unusable: dict[int, str]
    """Counts that cannot run here, with the reason (e.g. 'needs 4 GPUs, 1 visible')."""
    on_event: Callable[[str], None] = lambda message: None
    cache: dict[Any, Any] = field(default_factory=dict)
    """Results shared between checks (the single-rank latents)."""

    @property
    def dtype(self) -> str:
        return self.spec.dtype

    def backend_at(self, count: int) -> str:
        return "none" if count == 1 else self.world.backend

    def skip_rows(self, check: str, variants: Sequence[str], count: int) -> list[CheckRow]:
        return [skipped(check, v, count, self.dtype, self.unusable[count]) for v in variants]

    def measure(self, check: str, fn: RankMeasure, count: int) -> list[CheckRow]:
        """`fn` on the first `count` ranks, combined into one row per variant."""
        self.on_event(f"{check} at {count} rank{'s' if count > 1 else ''}")
        results = self.world.run(measure_on_first_ranks, fn, count, self.spec)
        return combine(check, count, self.backend_at(count), self.dtype, results[:count])

    def side_by_side(self, jobs: Sequence[tuple[Callable[..., Any], tuple]]) -> list[Any]:
        """Single-rank jobs, as many at a time as the World has ranks; results in job order."""
        results: list[Any] = []
        size = self.world.world_size
        for start in range(0, len(jobs), size):
            wave = list(jobs[start : start + size])
            results.extend(self.world.run(jobs_on_own_ranks, wave)[: len(wave)])
        return results


@dataclass(frozen=True)
class Check:
    """A named check: what its rows are called, and how it runs on a session."""

    name: str
    summary: str
    variants: tuple[str, ...]
    run: Callable[[Session, "Check"], list[CheckRow]]


def at_each_count(fn: RankMeasure) -> Callable[[Session, Check], list[CheckRow]]:
    """A check that runs rank function `fn` at every count (skipped rows for counts that cannot run)."""

    def run(session: Session, check: Check) -> list[CheckRow]:
        rows: list[CheckRow] = []
        for count in session.counts:
            if count in session.unusable:
                rows.extend(session.skip_rows(check.name, check.variants, count))
            else:
                rows.extend(session.measure(check.name, fn, count))
        return rows

    return run
