"""A step cache for the denoising loop: First-Block Cache (`--cache fbcache:THRESHOLD`).

Across the steps of one request, the first block's residual (its output minus its input) changes
little where the whole stack's does; First-Block Cache (ParaAttention's, diffusers'
`hooks/first_block_cache.py`, Cache-DiT's) runs block 0 at every step and, where its residual
moved less than THRESHOLD since the last step that ran every block, skips the other blocks and
adds instead what they added then (their residual, kept per row). The change is

    sum |r_0(step) - r_0(last computed)| / sum |r_0(last computed)|

(diffusers' ratio of means, written as sums: the same number), over EVERY row of the sequence:
each rank holds only its rows, so the two sums are the `agree` function's (the denoiser gives a
sum over the sequence's ranks in rank order; at one rank the identity). Every rank of a sequence
then takes the same decision, and every rank count takes the one-rank decision (up to a
change within the sums' rounding of the threshold). A step is skipped only where the change is
below the threshold: threshold 0 never skips, and its latents are bitwise the uncached run's
(the blocks compute the same; the cache only copies). The first step always computes.

The model file asks the cache (`FirstBlockCache.forward`) and names no rank: the sum over ranks is
handed in. Memory: per sequence and rank, the head and tail residuals kept across steps and two
copies of the stream during a step, 4 x rows x hidden in the stream dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch

Blocks = Callable[[torch.Tensor], torch.Tensor]
SumOverRanks = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class CachePolicy:
    """What `--cache` asked for: `off`, or `fbcache:THRESHOLD` (a finite number >= 0)."""

    kind: str = "off"
    threshold: float = 0.0

    @classmethod
    def parse(cls, text: str) -> "CachePolicy":
        """`off` or `fbcache:T`; a ValueError saying what is accepted otherwise."""
        value = text.strip().lower()
        if value == "off":
            return cls()
        kind, _, threshold = value.partition(":")
        if kind != "fbcache" or not threshold:
            raise ValueError("not a step cache: give off or fbcache:THRESHOLD (e.g. fbcache:0.08)")
        try:
            number = float(threshold)
        except ValueError:
            raise ValueError(f"the threshold {threshold!r} is not a number (e.g. fbcache:0.08)") from None
        if not math.isfinite(number) or number < 0:
            raise ValueError("the threshold must be a finite number >= 0 (0 never skips a step)")
        return cls("fbcache", number)

    def __str__(self) -> str:
        return "off" if self.kind == "off" else f"fbcache:{self.threshold:g}"

    @property
    def on(self) -> bool:
        return self.kind != "off"


@dataclass
class FirstBlockCache:
    """One sequence's First-Block Cache over the steps of one request (module docstring)."""

    threshold: float
    agree: SumOverRanks
    head: torch.Tensor | None = None  # block 0's residual at the last step that ran every block
    tail: torch.Tensor | None = None  # what blocks 1.. added at that step
    skipped: list[int] = field(default_factory=list)  # the steps whose blocks 1.. were skipped
    changes: list[float] = field(default_factory=list)  # each step's agreed change (inf: nothing to compare)
    step: int = 0

    def forward(self, x: torch.Tensor, first: Blocks, rest: Blocks) -> torch.Tensor:
        """The blocks' output for stream `x`: `first` (block 0), then `rest` (blocks 1..) or their
        cached residual. `first` and `rest` may write into their input (h3's blocks do)."""
        before = x.clone()
        x = first(x)
        head = x - before
        skip = self._skip(head)
        self.step += 1
        if skip and self.tail is not None:
            return x + self.tail  # the tail: the stream dtype, this rank's rows
        self.head = head
        after_first = x.clone()
        x = rest(x)
        self.tail = x - after_first
        return x

    def _skip(self, head: torch.Tensor) -> bool:
        if self.head is None or self.tail is None or self.head.shape != head.shape:
            self.changes.append(math.inf)
            return False
        local = torch.stack([(head - self.head).abs().sum(dtype=torch.float64), self.head.abs().sum(dtype=torch.float64)])
        moved, size = (float(v) for v in self.agree(local).tolist())
        change = moved / size if size > 0 else math.inf
        self.changes.append(change)
        if change < self.threshold:
            self.skipped.append(self.step)
            return True
        return False
