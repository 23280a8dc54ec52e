"""What one rank's parallel wrappers share: group, head partition, the current sequence's token
partition, and the byte counters of every collective they call."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

from h3core import partition
from h3core.collectives import CommStats, gather_rows
from h3core.partition import Span


class ParallelRuntime:
    def __init__(self, group, rank: int, world_size: int, num_heads: int):
        self.group = group
        self.rank = rank
        self.world_size = world_size
        self.heads: list[Span] = partition.head_spans(num_heads, world_size)
        self.stats = CommStats()
        self._tokens: list[Span] | None = None

    @property
    def tokens(self) -> list[Span]:
        """Token spans of every rank for the sequence being processed (set by `sequence`)."""
        if self._tokens is None:
            raise RuntimeError("no sequence layout set: run the model inside runtime.sequence(token_spans)")
        return self._tokens

    @property
    def rows(self) -> Span:
        return self.tokens[self.rank]

    @contextmanager
    def sequence(self, tokens: list[Span]) -> Iterator[None]:
        """Run forwards of a packed sequence split as `tokens` (one span per rank, in rank order)."""
        if len(tokens) != self.world_size:
            raise ValueError(f"{len(tokens)} token spans for {self.world_size} ranks")
        previous, self._tokens = self._tokens, tokens
        try:
            yield
        finally:
            self._tokens = previous

    def guard_rows(self, model: torch.nn.Module) -> None:
        """Check at every forward that the rows a rank feeds the model are exactly its token span."""

        def hook(module: torch.nn.Module, args: tuple) -> None:
            held = args[0].rope.rows  # args[0]: the PackedSequence
            if held != self.rows:
                raise RuntimeError(f"rank {self.rank} holds rows {held} but its token span is {self.rows}")

        model.register_forward_pre_hook(hook)

    def gather(self, x: torch.Tensor, spans: list[Span]) -> torch.Tensor:
        """All ranks' rows of `x` (split as `spans`), in rank order."""
        return gather_rows(x, spans, self.group, self.stats)
