"""What one rank's parallel wrappers share: group, head partition, the current sequence's token
partition, the byte counters of every collective they call, and the NVFP4 activation-scale
agreement of the linears whose input the ranks split."""

from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING, Iterator, Sequence

import torch
import torch.distributed as dist

from h3core import partition
from h3core.collectives import CommStats, gather_rows
from h3core.partition import SegmentKind, Span

if TYPE_CHECKING:
    from h3core.model import H3Model
    from h3core.nvfp4.linear import NVFP4Linear

ALL_REDUCE_MAX = "all_reduce_max"


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

    def max_over_ranks(self, value: torch.Tensor) -> torch.Tensor:
        """The elementwise max of `value` over the group's ranks (all-reduce MAX; a new tensor).

        Counted as if each rank sent its value to every other rank (what the result depends on).
        """
        out = value.detach().clone()
        if self.group is not None and self.world_size > 1:
            dist.all_reduce(out, op=dist.ReduceOp.MAX, group=self.group)
            moved = out.numel() * out.element_size() * (self.world_size - 1)
            self.stats.record(ALL_REDUCE_MAX, moved, moved)
        return out

    def agree_activation_scales(self, model: "H3Model", linears: Sequence["NVFP4Linear"]) -> None:
        """Make the NVFP4 `linears`, whose input the ranks split (rows or columns), quantize their
        activations with one global scale: the amax of the whole input, all-reduced (used on the fp4
        paths when the checkpoint has no `input_scale`). A rank without text rows never calls
        `model.text_embed`, so a model pre-hook has it join that agreement with an amax of 0."""
        if self.world_size == 1:
            return
        for linear in linears:
            linear.agree_amax = self.max_over_ranks
        if any(linear is model.text_embed for linear in linears):
            model.register_forward_pre_hook(_join_text_agreement)


def _join_text_agreement(model: torch.nn.Module, args: tuple) -> None:
    sequence = args[0]  # the PackedSequence of this rank's rows
    if not any(segment.kind is SegmentKind.TEXT for segment in sequence.segments):
        model.text_embed.join_amax_agreement()
