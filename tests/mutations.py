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
