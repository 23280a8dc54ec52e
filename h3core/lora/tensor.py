"""Tensor mode's cut of a branch: exactly the cut of the linear it sits beside (DESIGN.md §8).

Tensor mode replaces each block's `TENSOR_PARALLEL` linear by this rank's shard and calls
`follow_tensor_split(shard, split, part)` where it does: the shard remembers its cut
(`BranchCut`), so that a branch attached to it later (`h3core.lora.attach`, at load or when a
request brings other adapters) is cut the same way by `split_branch_for_tensor`:

- column-parallel (qkv_proj: this rank's heads inside each of q, k, v; fc1: its feature range in the
  gate half and the up half): B's rows as the shard's rows, in the shard's order; A whole;
- row-parallel (out_proj, fc2: input columns): A's columns as the shard's columns; B whole. The
  partial `B(A_cols x_cols)` is added to the linear's partial output, so it joins the same
  reduce-scatter (no collective of its own).

On the fp4 paths tensor mode gathers the column-parallel linears' inputs as NVFP4 codes; a branch
needs the rows themselves, so each rank projects its own rows (`A x_loc`, [m, R]) and those few
bytes per row travel in that same gather (`h3core.parallel.modes.tensor._gather_codes`).

Ulysses keeps every branch whole: its linears are whole.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from h3core.lora.branch import LowRankBranch
from h3core.model.dit import Split
from h3core.nvfp4.layout import ColumnSlice
from h3core.span import Span

CUT = "lora_cut"
"""The attribute of a shard that says how it was cut (a `BranchCut`)."""


@dataclass(frozen=True)
class BranchCut:
    """How tensor mode cut one linear: its split and this rank's part (rows or columns)."""

    split: Split
    part: list[Span] | ColumnSlice


def split_branch_for_tensor(branch: LowRankBranch, split: Split, part: list[Span] | ColumnSlice) -> LowRankBranch:
    """`branch` cut as its linear was: `split` COLUMN keeps output rows `part` (B's rows), ROW the
    input columns `part` (A's columns)."""
    if split is Split.COLUMN:
        return branch.rows_cut(part)  # type: ignore[arg-type]
    return branch.columns_cut(part.elements)  # type: ignore[union-attr]


def follow_tensor_split(shard: nn.Module, split: Split, part: list[Span] | ColumnSlice) -> None:
    """Where tensor mode puts `shard` in a linear's place: remember the cut for every branch attached later."""
    setattr(shard, CUT, BranchCut(split, part))


def cut_for(linear: nn.Module, branch: LowRankBranch) -> LowRankBranch:
    """`branch` as `linear` holds it: cut like the linear where tensor mode cut it, else whole."""
    cut: BranchCut | None = getattr(linear, CUT, None)
    return branch if cut is None else split_branch_for_tensor(branch, cut.split, cut.part)
