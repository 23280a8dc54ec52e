"""A parallel plan: the partition contract applied to one model and one run.

`ParallelPlan.build` validates everything a distributed run needs (no empty head, token or
NVFP4-block partition; block-aligned attention-output columns) before any process is spawned.
`h3 plan` prints it; the runtime shards the model with it.
"""

from __future__ import annotations

from enum import Enum

from pydantic import BaseModel, ConfigDict

from h3core import partition
from h3core.config import ModelConfig
from h3core.partition import Segment, Span


class Mode(str, Enum):
    ULYSSES = "ulysses"
    TENSOR = "tensor"


class SpanModel(BaseModel):
    """A `[start, stop)` range as it appears in reports."""

    model_config = ConfigDict(frozen=True)
    start: int
    stop: int

    @classmethod
    def of(cls, span: Span) -> "SpanModel":
        return cls(start=span.start, stop=span.stop)

    @property
    def span(self) -> Span:
        return Span(self.start, self.stop)


class SegmentModel(BaseModel):
    model_config = ConfigDict(frozen=True)
    kind: str
    start: int
    stop: int

    @classmethod
    def of(cls, seg: Segment) -> "SegmentModel":
        return cls(kind=seg.kind.value, start=seg.start, stop=seg.stop)


class ColumnsModel(BaseModel):
    """Block-aligned input columns of an NVFP4 weight, in the three units that address them."""

    model_config = ConfigDict(frozen=True)
    elements: SpanModel
    packed_bytes: SpanModel
    scale_columns: SpanModel

    @classmethod
    def of(cls, cols: partition.ColumnSlice) -> "ColumnsModel":
        return cls(
            elements=SpanModel.of(cols.elements),
            packed_bytes=SpanModel.of(cols.packed_bytes),
            scale_columns=SpanModel.of(cols.scale_columns),
        )


class TensorShards(BaseModel):
    """What one rank holds of each block's NVFP4 linears in tensor mode."""

    model_config = ConfigDict(frozen=True)
    qkv_rows: list[SpanModel]
    """Rows of the fused [q | k | v] weight, one span per third."""
    attn_out_columns: ColumnsModel
    fc1_rows: list[SpanModel]
    """Rows of the fused [gate | value] FC1 weight: the gate span, then the value span."""
    fc2_columns: ColumnsModel


class RankPlan(BaseModel):
    model_config = ConfigDict(frozen=True)
    rank: int
    heads: SpanModel
    tokens: SpanModel
    segments: list[SegmentModel]
    """This rank's segments, clipped to its token interval and rebased to local rows."""
    tensor: TensorShards | None = None


class WeightBytes(BaseModel):
    """Checkpoint bytes of a model, and what each rank of a plan holds of them."""

    model_config = ConfigDict(frozen=True)
    parameters: int
    """Weights (NVFP4 elements + dense values)."""
    checkpoint_bytes: int
    """Tensor bytes of the checkpoint (NVFP4 packed codes and scales, dense tensors in bf16)."""
    nvfp4_bytes: int
    block_linears_bytes: int
    """The per-block QKV/Out/FC1/FC2 (with biases): what tensor mode splits."""
    per_rank: list[int]
    """Bytes each rank holds: all of it in Ulysses mode; replicated parts + its shards in tensor mode."""


class ParallelPlan(BaseModel):
    model_config = ConfigDict(frozen=True)
    mode: Mode
    world_size: int
    preset: str
    num_heads: int
    head_dim: int
    mlp_width: int
    num_tokens: int
    segments: list[SegmentModel]
    heads: list[int]
    """Heads per rank."""
    tokens: list[int]
    """Tokens per rank."""
    ranks: list[RankPlan]
    weights: WeightBytes | None = None
    """Filled by `h3 plan` (needs the model's schema); None inside a run."""

    @classmethod
    def build(cls, config: ModelConfig, world_size: int, mode: Mode, segments: list[Segment]) -> "ParallelPlan":
        """Apply the partition contract; raise `PartitionError` for any empty or misaligned part."""
        num_tokens = segments[-1].stop if segments else 0
        head_spans = partition.head_spans(config.num_heads, world_size)
        token_spans = partition.token_spans(num_tokens, world_size)
        tensor = None
        if mode is Mode.TENSOR:
            out_cols = partition.head_column_slices(config.num_heads, config.head_dim, world_size)
            fc2_cols = partition.nvfp4_column_slices(config.mlp_width, world_size)
            tensor = [
                TensorShards(
                    qkv_rows=[SpanModel.of(s) for s in partition.fused_qkv_rows(heads, config.num_heads, config.head_dim)],
                    attn_out_columns=ColumnsModel.of(out),
                    fc1_rows=[SpanModel.of(s) for s in partition.gate_value_rows(fc2, config.mlp_width)],
                    fc2_columns=ColumnsModel.of(fc2),
                )
                for heads, out, fc2 in zip(head_spans, out_cols, fc2_cols)
            ]
        ranks = [
            RankPlan(
                rank=rank,
                heads=SpanModel.of(heads),
                tokens=SpanModel.of(tokens),
                segments=[SegmentModel.of(s) for s in partition.clip_segments(segments, tokens)],
                tensor=tensor[rank] if tensor else None,
            )
            for rank, (heads, tokens) in enumerate(zip(head_spans, token_spans))
        ]
        return cls(
            mode=mode,
            world_size=world_size,
            preset=config.name,
            num_heads=config.num_heads,
            head_dim=config.head_dim,
            mlp_width=config.mlp_width,
            num_tokens=num_tokens,
            segments=[SegmentModel.of(s) for s in segments],
            heads=[len(s) for s in head_spans],
            tokens=[len(s) for s in token_spans],
            ranks=ranks,
        )

