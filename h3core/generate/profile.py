"""`--profile`: where a denoising step's time goes on each rank.

Categories: `attention` (the attention kernel itself: every `AttentionKernel` of the model, without
the all-to-alls around it), `nvfp4_linears` (every `NVFP4Linear` forward, weight decoding included
on the dequant paths), one per collective kind (`seq_to_head`, `head_to_seq`, `gather_rows`,
`reduce_scatter_rows`, `repartition_rows`, `cfg_exchange`, `broadcast`; waiting for a late peer counts there), and
`rest`: the step's time minus all of them (norms, RoPE, modulation, residuals, the sampler, Python).

Overlapped collectives (`--ulysses-overlap`, `collectives.InFlight`) count in their category only the
time this rank spent in their own code: starting them, blocked waiting for them, unpacking what
arrived: the *exposed* communication. On the CPU each one's time from start to arrival is logged
too (`in_flight`, per step and kind): about `in_flight - exposed` of it ran behind computation
(about: the exposed time also holds the starting and unpacking). On CUDA the collectives' own
stream is not timed: exposed only.

How: forward hooks on those modules and the rank's `CommStats.timer`, applied to a finished model
from outside (the model file stays as it is); nothing is registered when profiling is off. Regions
nest (a collective inside a hooked module, a collective calling another): each region's time counts
once, in the innermost category it belongs to (exclusive time). On the CPU the clock is
`perf_counter`; on CUDA each region records a pair of CUDA events on the current stream and the
times are read once the step has finished, so asynchronous kernels are attributed to the region
that queued them and the figures are device time, not launch time.
"""

from __future__ import annotations

import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from statistics import mean
from typing import Any, Iterable, Iterator

import torch
from pydantic import BaseModel, Field

from h3core.model.attention.dispatch import AttentionKernel
from h3core.nvfp4.linear import NVFP4Linear
from h3core.parallel import collectives
from h3core.parallel.collectives import CommStats, FlightLog

ATTENTION, LINEARS, REST = "attention", "nvfp4_linears", "rest"
COLLECTIVES = (
    collectives.SEQ_TO_HEAD, collectives.HEAD_TO_SEQ, collectives.GATHER_ROWS,
    collectives.REDUCE_SCATTER_ROWS, collectives.REPARTITION_ROWS, collectives.CFG_EXCHANGE, collectives.BROADCAST,
)
CATEGORIES = (ATTENTION, LINEARS, *COLLECTIVES, REST)


class RankProfile(BaseModel):
    """One rank's split of every step: seconds per category (they add up to the step)."""

    rank: int
    clock: str = Field(description="'cuda events' or 'perf_counter'.")
    steps: list[dict[str, float]] = Field(description="Per denoising step: seconds per category, and 'step' (the total).")
    in_flight: list[dict[str, float]] = Field(default_factory=list, description="Per step: seconds the overlapped collectives of each kind spent from start to arrival (CPU; empty when none ran).")

    @property
    def mean(self) -> dict[str, float]:
        """Seconds per step, per category, averaged over the run's steps."""
        return mean_split(self.steps)


class RunProfile(BaseModel):
    """The profile of a run: every rank's split, and their average."""

    categories: list[str] = Field(default_factory=lambda: list(CATEGORIES))
    ranks: list[RankProfile]
    mean: dict[str, float] = Field(description="Seconds per step per category: mean over steps, then over ranks.")
    steady_mean: dict[str, float] = Field(description="The same without the first step (one-time warm-up).")
    in_flight_mean: dict[str, float] = Field(default_factory=dict, description="Overlapped collectives: seconds per step from start to arrival, per kind, mean over steps, then ranks (CPU).")

    @classmethod
    def of(cls, ranks: list[RankProfile]) -> "RunProfile":
        return cls(
            ranks=ranks,
            mean=mean_split([r.mean for r in ranks]),
            steady_mean=mean_split([mean_split(r.steps[1:] or r.steps) for r in ranks]),
            in_flight_mean=mean_split([mean_split(r.in_flight) for r in ranks if r.in_flight]),
        )

    def overlap_line(self) -> str | None:
        """Exposed vs in-flight communication of the overlapped collectives, per step (None: none ran)."""
        if not self.in_flight_mean:
            return None
        exposed = sum(self.mean.get(kind, 0.0) for kind in self.in_flight_mean)
        whole = sum(self.in_flight_mean.values())
        hidden = max(0.0, whole - exposed)
        return (f"overlapped all-to-alls ({', '.join(k.replace('_', ' ') for k in self.in_flight_mean)}): {exposed * 1e3:.2f} ms exposed "
                f"(starting, blocked, unpacking) against {whole * 1e3:.2f} ms in flight per step: about {hidden / whole if whole > 0 else 0.0:.0%} hidden")


def mean_split(splits: list[dict[str, float]]) -> dict[str, float]:
    """Per key, the mean over `splits` (a key missing from one split counts as 0 there)."""
    keys = sorted({k for s in splits for k in s})
    return {k: mean(s.get(k, 0.0) for s in splits) for k in keys} if splits else {}


def collective_seconds(split: dict[str, float]) -> float:
    return sum(split.get(kind, 0.0) for kind in COLLECTIVES)


# --- timing ------------------------------------------------------------------------------------------


@dataclass
class _Region:
    name: str
    start: Any  # float (perf_counter) or torch.cuda.Event
    end: Any = None
    children: list[int] = field(default_factory=list)


class Profiler:
    """Times regions of the steps of one rank; `attach` a model, then run each step inside `step()`."""

    def __init__(self, device: torch.device, rank: int = 0):
        self.device = device
        self.rank = rank
        self.cuda = device.type == "cuda"
        self.steps: list[dict[str, float]] = []
        self._regions: list[_Region] = []
        self._stack: list[int] = []
        self._in_step = False
        self._handles: list[Any] = []
        self._events: list[torch.cuda.Event] = []
        self._used_events = 0
        self._flights = FlightLog()
        self.in_flight: list[dict[str, float]] = []

    # -- wiring -----------------------------------------------------------------------------------

    def attach(self, model: torch.nn.Module, stats: "CommStats | None" = None) -> "Profiler":
        """Hook every NVFP4 linear and every attention kernel of `model`, and the collectives
        that count into `stats` (the rank's counters: their `timer`)."""
        for module in model.modules():
            name = LINEARS if isinstance(module, NVFP4Linear) else ATTENTION if isinstance(module, AttentionKernel) else None
            if name is not None:
                self._handles.append(module.register_forward_pre_hook(lambda m, a, n=name: self._enter(n)))
                self._handles.append(module.register_forward_hook(lambda m, a, o: self._exit()))
        self._stats = stats
        if stats is not None:
            stats.timer = self.region
            stats.flights = self._flights
        return self

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if getattr(self, "_stats", None) is not None:
            self._stats.timer = None
            self._stats.flights = None

    def result(self) -> RankProfile:
        in_flight = self.in_flight if any(self.in_flight) else []
        return RankProfile(rank=self.rank, clock="cuda events" if self.cuda else "perf_counter", steps=self.steps, in_flight=in_flight)

    # -- regions ----------------------------------------------------------------------------------

    @contextmanager
    def step(self) -> Iterator[None]:
        """One denoising step: its regions are resolved into a split when it ends."""
        self._regions, self._stack, self._used_events, self._in_step = [], [], 0, True
        start = self._mark()
        try:
            yield
        finally:
            self._in_step = False
        end = self._mark()
        if self.cuda:
            end.synchronize()
        self.steps.append(self._split(self._seconds(start, end)))
        self.in_flight.append(self._flights.take())

    @contextmanager
    def region(self, name: str) -> Iterator[None]:
        self._enter(name)
        try:
            yield
        finally:
            self._exit()

    def _enter(self, name: str) -> None:
        if not self._in_step:
            return
        index = len(self._regions)
        if self._stack:
            self._regions[self._stack[-1]].children.append(index)
        self._regions.append(_Region(name, self._mark()))
        self._stack.append(index)

    def _exit(self) -> None:
        if self._in_step and self._stack:
            self._regions[self._stack.pop()].end = self._mark()

    def _mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        if self._used_events == len(self._events):
            self._events.append(torch.cuda.Event(enable_timing=True))
        event = self._events[self._used_events]
        self._used_events += 1
        event.record()
        return event

    def _seconds(self, start: Any, end: Any) -> float:
        return start.elapsed_time(end) / 1000.0 if self.cuda else end - start

    def _split(self, total: float) -> dict[str, float]:
        """Exclusive seconds per category (a region minus the regions nested in it), the rest, the total."""
        elapsed = [self._seconds(r.start, r.end) if r.end is not None else 0.0 for r in self._regions]
        split = {name: 0.0 for name in CATEGORIES}
        for region, seconds in zip(self._regions, elapsed):
            split[region.name] += seconds - sum(elapsed[c] for c in region.children)
        split[REST] = total - sum(split.values())
        split["step"] = total
        return split


@contextmanager
def profiling(model: torch.nn.Module, device: torch.device, rank: int, enabled: bool, stats: "CommStats | None" = None) -> Iterator[Profiler | None]:
    """A `Profiler` attached to `model` and the collectives counting into `stats` for the block
    (None when not enabled: nothing is registered)."""
    if not enabled:
        yield None
        return
    profiler = Profiler(device, rank).attach(model, stats)
    try:
        yield profiler
    finally:
        profiler.detach()


def step_context(profiler: Profiler | None) -> Any:
    """`profiler.step()`, or a context that does nothing."""
    return profiler.step() if profiler is not None else nullcontext()


def shares(split: dict[str, float]) -> Iterable[tuple[str, float, float]]:
    """(category, seconds, share of the step) for the categories that took any time, in CATEGORIES order."""
    total = split.get("step", 0.0) or sum(split.get(c, 0.0) for c in CATEGORIES)
    for name in CATEGORIES:
        seconds = split.get(name, 0.0)
        if seconds or name in (ATTENTION, LINEARS, REST):
            yield name, seconds, (seconds / total if total > 0 else 0.0)
