"""Timing A against B on a shared machine: interleaved rounds, and what a spread of times can mean.

Load on a shared machine drifts over seconds, so arms timed one after the other (all of A, then
all of B) compare two different machines. `rounds` interleaves them: every round runs every arm
once, forward in even rounds and backward in odd ones (A B C, C B A, A B C, ...), so that drift
and "whoever runs second finds the cache dirty" fall on every arm alike. `alternate` times arms in
that order; `Spread` is what repeated times of one arm say (min, median, max); `beyond_ideal`
flags a speedup above the ideal by more than its own spread: the baseline stalled (noise), it
did not scale.

Used by `h3 matrix --repeat` (cells interleaved across the whole matrix) and the A/B scripts in
`scripts/` (`bench_nvfp4_linear.py`, `bench_gpu_kernels.py`).
"""

from __future__ import annotations

import statistics
from typing import Callable, Sequence, TypeVar

from pydantic import BaseModel, Field

T = TypeVar("T")

NOISE = "noise, not scaling"
"""The flag of a speedup above the ideal by more than its spread (`beyond_ideal`)."""


def rounds(arms: Sequence[T], repeat: int) -> list[T]:
    """The order `repeat` interleaved rounds run `arms` in: forward, then backward, alternately."""
    order: list[T] = []
    for index in range(repeat):
        order.extend(arms if index % 2 == 0 else list(reversed(arms)))
    return order


def alternate(arms: dict[str, Callable[[], float]], repeat: int, warmup: int = 1) -> dict[str, list[float]]:
    """Each arm's `repeat` times (an arm returns the seconds it measured), in interleaved `rounds`
    after `warmup` untimed rounds of the same order."""
    names = list(arms)
    for name in rounds(names, warmup):
        arms[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for name in rounds(names, repeat):
        times[name].append(arms[name]())
    return times


def ratios(numerator: list[float], denominator: list[float]) -> list[float]:
    """Per-round ratios of two arms timed in the same rounds (drift cancels within a round)."""
    return [a / b for a, b in zip(numerator, denominator) if b > 0]


class Spread(BaseModel):
    """What repeated measurements of one figure say: its least, middle and greatest value."""

    min: float
    median: float
    max: float

    @classmethod
    def of(cls, values: Sequence[float]) -> "Spread":
        return cls(min=min(values), median=statistics.median(values), max=max(values))

    @property
    def width(self) -> float:
        return self.max - self.min

    def scaled_against(self, baseline: "Spread") -> "Spread":
        """The speedup `baseline / self` (times in seconds) with its extremes: the slowest baseline over
        the fastest run is its greatest, the fastest baseline over the slowest run its least."""
        return Spread(min=baseline.min / self.max, median=baseline.median / self.median, max=baseline.max / self.min)


def beyond_ideal(speedup: Spread | None, ideal: float) -> bool:
    """True where the speedup's median is above the ideal by more than its spread's width: more than
    linear scaling that measurement spread cannot explain, so the baseline was slowed (load), and the
    figure is noise, not scaling (`NOISE`)."""
    return speedup is not None and speedup.median - ideal > speedup.width
