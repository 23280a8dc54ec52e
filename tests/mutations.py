"""Broken pieces that tests patch into the ranks of a World, to show that a check fails on a real bug
(module-level, so that spawned ranks can unpickle them)."""

from __future__ import annotations

from contextlib import contextmanager
from types import ModuleType
from typing import Iterator

import torch

import h3core.parallel.collectives
from h3core.verify.transport import measure_ragged


def drop_last_rank(reduce_scatter):  # type: ignore[no-untyped-def]
    """A reduce-scatter that loses the last rank's partial (the rank sends zeros instead)."""

    def broken(x, rows, group=None, stats=None, scratch=None):  # type: ignore[no-untyped-def]
        rank, size = h3core.parallel.collectives.group_rank_and_size(group)
        if rank == size - 1:
            x = torch.zeros_like(x)
        return reduce_scatter(x, rows, group, stats, scratch)

    return broken


@contextmanager
def dropping_last_rank(module: ModuleType) -> Iterator[None]:
    """`module.reduce_scatter_rows` is `drop_last_rank` of itself while inside (patch where it is looked up)."""
    real = module.reduce_scatter_rows
    module.reduce_scatter_rows = drop_last_rank(real)
    try:
        yield
    finally:
        module.reduce_scatter_rows = real


def ragged_with_broken_reduce_scatter(ctx, spec):  # type: ignore[no-untyped-def]
    """Runs on every rank: the ragged check with a reduce-scatter that loses the last rank's partial."""
    with dropping_last_rank(h3core.parallel.collectives):
        return measure_ragged(ctx, spec)


@contextmanager
def shifted_condition_rows(active: bool) -> Iterator[None]:
    """While inside (when `active`): every rank feeds its keyframe condition rows one row off (each row
    gets its neighbour's features), as an off-by-one slice of the condition rows would."""
    from h3core.generate.sequences import Sequence
    from h3core.model.sequence import SegmentKind

    real = Sequence.local_inputs

    def broken(self, rank, latent):  # type: ignore[no-untyped-def]
        seq = real(self, rank, latent)
        rows = seq.features.get(SegmentKind.CONDITION)
        if rows is not None:
            seq.features[SegmentKind.CONDITION] = rows.roll(1, 0)
        return seq

    if active:
        Sequence.local_inputs = broken  # type: ignore[method-assign]
    try:
        yield
    finally:
        Sequence.local_inputs = real  # type: ignore[method-assign]
