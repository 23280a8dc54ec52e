"""What one rank's parallel wrappers share, made from the run's `ParallelPlan`: the process group, the
head spans (and Ulysses overlap's head groups, `head_groups`), the byte counters of every collective they call and the CPU scratch buffer those
collectives reuse (`Scratch`), the NVFP4 activation-scale agreement of the linears whose input the
ranks split, a record of the spans and shards this rank really used (`RankUsage`, in the run's
report), and of the attention kernels and NVFP4 paths it ran (`RankRecord`). Everything here lives
as long as the rank's loaded pipeline, and nothing of it is module state.

Which rows a forward runs travels with the call: a packed sequence's token spans are a function of
its length (`token_spans`, the plan's balanced split), so Ulysses' processor and tensor mode's
attention hooks read them from their own input (`rope.num_tokens`). Tensor mode's MLP hooks see rows
only; the model's outermost hook (`guard_rows`) reads the spans from the forward's input and holds
them for exactly that forward (`forward_tokens`).

The group is the process group of the plan's ranks: the run's whole world when its layout is one
group, else this rank's sequence group (`h3core.parallel.layout.RankGroups`); every collective
here takes it from the runtime, never the world group. With CFG parallel the runtime also carries
this rank's half (`cfg`): its branch and the group of both halves, which the loop's one exchange
per step uses.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Sequence

import torch
import torch.distributed as dist
from pydantic import BaseModel, Field

from h3core.model.attention.dispatch import AttentionKernel
from h3core.nvfp4.linear import NVFP4Linear
from h3core.parallel import partition
from h3core.parallel.collectives import CommStats, Scratch, gather_rows
from h3core.parallel.layout import CfgHalf
from h3core.parallel.modes.tensor_shards import TensorShards
from h3core.parallel.plan import ParallelPlan
from h3core.span import Span


ALL_REDUCE_MAX = "all_reduce_max"
ALL_GATHER_SUM = "all_gather_sum"  # the step cache's agreed change (h3core.model.step_cache)


class RankUsage(BaseModel):
    """The spans and shards one rank ran with, recorded where they were used (compare with its `RankPlan`)."""

    heads: Span | None = Field(None, description="The heads this rank attended: its block of Ulysses' all-to-all, or its QKV shard's heads.")
    tokens: dict[str, Span] = Field(default_factory=dict, description="Per sequence ('prompt', 'negative prompt'): the rows the model was fed.")
    shards: TensorShards | None = Field(None, description="Tensor mode: the ranges of each block linear read as this rank's shards.")


class RankRecord:
    """What one rank ran, counted where it ran and kept on its runtime (no process-wide state): the
    attention kernel of every `attend` call, the NVFP4 path of every GEMM call, and the (M, N, K) of
    every fp4 GEMM (padded as the GEMM takes it: what the fp4 self-test must have covered). `attach`
    points a model's attention cores and NVFP4 linears at it; `clear` starts a request's record."""

    def __init__(self) -> None:
        self.attention: Counter[str] = Counter()
        self.nvfp4: Counter[str] = Counter()
        self.fp4_shapes: Counter[tuple[int, int, int]] = Counter()

    def attach(self, model: torch.nn.Module) -> None:
        for module in model.modules():
            if isinstance(module, AttentionKernel):
                module.record = self.attention
            elif isinstance(module, NVFP4Linear):
                module.record, module.shapes = self.nvfp4, self.fp4_shapes

    def clear(self) -> None:
        self.attention.clear()
        self.nvfp4.clear()
        self.fp4_shapes.clear()

    def gemm_shapes(self) -> list[list[int]]:
        """Every distinct fp4 GEMM (M, N, K) this rank ran, sorted."""
        return [list(shape) for shape in sorted(self.fp4_shapes)]

    def kernels(self) -> dict[str, int]:
        return dict(sorted(self.attention.items()))

    def paths(self) -> dict[str, int]:
        return dict(sorted(self.nvfp4.items()))


class ParallelRuntime:
    """One rank's view of a `ParallelPlan`: see the module docstring."""

    def __init__(self, plan: ParallelPlan, rank: int, group: Any, cfg: CfgHalf | None = None):
        self.plan = plan
        self.rank = rank  # within the group: the index into the plan's spans and shards
        self.group = group  # None at one rank: every collective is then the identity
        self.cfg = cfg  # CFG parallel: this rank's branch and the group of both halves
        self.world_size = plan.world_size
        self.heads: list[Span] = plan.head_spans
        # Ulysses overlap: the all-to-alls' head groups (one group, all heads: not overlapped)
        self.head_groups = partition.head_groups(self.heads, plan.overlap.groups if plan.overlap is not None else 1)
        self.stats = CommStats()
        self.scratch = Scratch()
        self.used = RankUsage()
        self.record = RankRecord()
        self._forward_tokens: list[Span] | None = None

    def new_records(self) -> None:
        """Start the records of one request: fresh collective counters, kernels and paths run and rows
        used (the heads and shards stay: they are the loaded model's, the same for every request)."""
        self.stats = CommStats()
        self.used = self.used.model_copy(update={"tokens": {}})
        self.record.clear()

    def token_spans(self, num_tokens: int) -> list[Span]:
        """Every rank's token rows of a packed sequence of `num_tokens` rows (the plan's split of it)."""
        return partition.token_spans(num_tokens, self.world_size)

    @property
    def forward_tokens(self) -> list[Span]:
        """The token spans of the sequence the running forward was given (set by `guard_rows` for
        that forward only), for the hooks whose input is rows only (tensor mode's MLP)."""
        if self._forward_tokens is None:
            raise RuntimeError("a parallel hook ran outside a forward of the parallelized model (guard_rows sets the rows it runs)")
        return self._forward_tokens

    def enter_forward(self, rows: Span, num_tokens: int) -> None:
        """What the model's outermost hook does before every forward: the rows fed must be this rank's
        span of a sequence of `num_tokens` rows; that sequence's spans are the forward's (`forward_tokens`)."""
        tokens = self.token_spans(num_tokens)
        if rows != tokens[self.rank]:
            raise RuntimeError(f"rank {self.rank} holds rows {rows} but its token span of {num_tokens} rows is {tokens[self.rank]}")
        self._forward_tokens = tokens

    def leave_forward(self) -> None:
        self._forward_tokens = None

    def guard_rows(self, model: torch.nn.Module) -> None:
        """At every forward of `model`, before anything else: `enter_forward` with the rows its input
        (a `PackedSequence`) holds; after it (also when it raises): `leave_forward`."""

        def enter(module: torch.nn.Module, args: tuple) -> None:
            rope = args[0].rope  # args[0]: the PackedSequence
            self.enter_forward(rope.rows, rope.num_tokens)

        model.register_forward_pre_hook(enter)
        model.register_forward_hook(lambda module, args, out: self.leave_forward(), always_call=True)

    def gather(self, x: torch.Tensor, spans: list[Span]) -> torch.Tensor:
        """All ranks' rows of `x` (split as `spans`), in rank order."""
        return gather_rows(x, spans, self.group, self.stats, self.scratch)

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

    def sum_over_ranks(self, value: torch.Tensor) -> torch.Tensor:
        """`value` summed over the group's ranks in rank order (an all-gather, then one sum: the same
        bits on every rank and at every backend; a new tensor). For a few numbers (the step cache's)."""
        if self.group is None or self.world_size <= 1:
            return value.detach().clone()
        parts = [torch.empty_like(value) for _ in range(self.world_size)]
        dist.all_gather(parts, value.detach().contiguous(), group=self.group)
        moved = value.numel() * value.element_size() * (self.world_size - 1)
        self.stats.record(ALL_GATHER_SUM, moved, moved)
        total = parts[0].clone()
        for part in parts[1:]:
            total += part
        return total

    def agree_activation_scales(self, linears: Sequence[torch.nn.Module]) -> None:
        """Make the NVFP4 `linears`, whose input the ranks split (rows or columns), quantize their
        activations with one global scale: the amax of the whole input, all-reduced (used on the fp4
        paths when the checkpoint has no `input_scale`). Dense linears have no activation scale."""
        if self.world_size == 1:
            return
        for linear in linears:
            if isinstance(linear, NVFP4Linear):
                linear.agree_amax = self.max_over_ranks
