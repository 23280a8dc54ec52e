"""What tensor mode splits (torch-free): which linears of every block, and how (`TENSOR_PARALLEL`), as
torchtitan's `parallelize_*` plans declare theirs (the model file names no split), and one rank's
ranges of them (`TensorShards`, computed once per run by `h3core.parallel.modes.tensor_plan`).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from pydantic import BaseModel, ConfigDict, Field

from h3core.nvfp4.layout import ColumnSlice
from h3core.span import Span


class Split(str, Enum):
    """How a linear divides over ranks in tensor mode (docs/nvfp4.md, "Tensor-parallel slicing")."""

    COLUMN = "column"
    """Output rows: each rank computes its rows of the output from the whole input; a bias is sliced with the rows."""
    ROW = "row"
    """Input columns (block aligned): each rank computes a partial output; a bias is added once after the sum."""


TENSOR_PARALLEL: dict[str, Split] = {
    "attn.qkv_proj": Split.COLUMN,  # the rows of this rank's heads, inside each of the q, k and v thirds
    "attn.out_proj": Split.ROW,  # the input columns of this rank's heads
    "mlp.fc1": Split.COLUMN,  # the same feature range inside the gate half and the up half
    "mlp.fc2": Split.ROW,  # the input columns of that feature range
}
"""The linears of every block that tensor mode splits, and how (module names inside a block). The
rest is replicated (the token refiner and the AdaLN projections included)."""


@dataclass(frozen=True)
class TensorCut:
    """How tensor mode cut one linear: its split and this rank's part (output rows, or input columns).
    Tensor mode leaves it on the shard (`tensor_cut`, a slot of h3's linears), so that what is attached
    beside the linear later (a LoRA branch, `h3core.lora`) is cut alike without either naming the other."""

    split: Split
    part: list[Span] | ColumnSlice



def tensor_parallel_prefixes(num_blocks: int) -> tuple[str, ...]:
    """State-dict prefixes of every block's `TENSOR_PARALLEL` linears (tensor mode reads them as shards)."""
    return tuple(f"blocks.{i}.{name}." for i in range(num_blocks) for name in TENSOR_PARALLEL)


class TensorShards(BaseModel):
    """What one rank holds of each block's linears in tensor mode (`TENSOR_PARALLEL`)."""

    model_config = ConfigDict(frozen=True)
    qkv_rows: list[Span] = Field(description="Rows of the stacked [q | k | v] weight, one span per third (this rank's heads).")
    attn_out_columns: ColumnSlice = Field(description="Input columns of out_proj (this rank's heads x head_dim).")
    fc1_rows: list[Span] = Field(description="Rows of the fused [gate | up] fc1 weight: the gate span, then the up span.")
    fc2_columns: ColumnSlice = Field(description="Input columns of fc2: the same feature range as fc1's rows, in whole NVFP4 blocks.")

    def rows_of(self, linear: str) -> list[Span]:
        """The output rows of column-parallel block linear `linear` ('attn.qkv_proj', 'mlp.fc1')."""
        return {"attn.qkv_proj": self.qkv_rows, "mlp.fc1": self.fc1_rows}[linear]

    def columns_of(self, linear: str) -> ColumnSlice:
        """The input columns of row-parallel block linear `linear` ('attn.out_proj', 'mlp.fc2')."""
        return {"attn.out_proj": self.attn_out_columns, "mlp.fc2": self.fc2_columns}[linear]

    def of(self, linear: str) -> list[Span] | ColumnSlice:
        """The range of block linear `linear`: its rows (column-parallel) or its columns (row-parallel)."""
        return self.rows_of(linear) if TENSOR_PARALLEL[linear] is Split.COLUMN else self.columns_of(linear)

    def cut_of(self, linear: str) -> TensorCut | None:
        """How block linear `linear` is cut on this rank (None: replicated, not a `TENSOR_PARALLEL` linear)."""
        return TensorCut(TENSOR_PARALLEL[linear], self.of(linear)) if linear in TENSOR_PARALLEL else None

    def heads(self, head_dim: int) -> Span:
        """The heads this rank's QKV rows hold (the q third: its heads x head_dim)."""
        q_rows = self.qkv_rows[0]
        return Span(q_rows.start // head_dim, q_rows.stop // head_dim)
