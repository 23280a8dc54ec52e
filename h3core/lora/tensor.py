"""Tensor mode's cut of a branch: exactly the cut of the linear it sits beside (DESIGN.md §8).

Tensor mode replaces each block's `TENSOR_PARALLEL` linear by this rank's shard and marks the shard
with its cut (`linear.tensor_cut`, a `TensorCut` of h3core.parallel.modes.tensor_shards: a split and
this rank's part), so that a branch attached to it later (`h3core.lora.attach`, at load or when a
request brings other adapters) is cut the same way by `split_branch_for_tensor`. Neither names the
other: the cut travels on the linear (a slot of h3's linears, h3core.nvfp4.linear).

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

from torch import nn

from h3core.lora.branch import LowRankBranch


def split_branch_for_tensor(branch: LowRankBranch, split: str, part) -> LowRankBranch:  # type: ignore[no-untyped-def]
    """`branch` cut as its linear was: `split` "column" keeps output rows `part` (spans: B's rows),
    "row" the input columns `part` (a column slice: A's columns)."""
    if split == "column":
        return branch.rows_cut(part)
    return branch.columns_cut(part.elements)


def cut_for(linear: nn.Module, branch: LowRankBranch) -> LowRankBranch:
    """`branch` as `linear` holds it: cut like the linear where tensor mode cut it, else whole."""
    cut = getattr(linear, "tensor_cut", None)
    return branch if cut is None else split_branch_for_tensor(branch, cut.split, cut.part)
