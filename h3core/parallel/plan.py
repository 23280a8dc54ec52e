"""The parallel plan: the partition contract applied to one run, built and validated once.

`ParallelPlan.build` runs in the launching process (`h3core.generate.resolve`, and `h3 plan`):
it applies `h3core.parallel.partition` to a model config, a rank count, a mode and every packed sequence of
the run (the prompt's and, with guidance, the negative prompt's), and raises `PartitionError` for
any empty or misaligned part before a process exists. The plan travels to every rank inside the
resolved run, and every rank consumes it (torchtitan's `ParallelDims` is the model):

- `h3core.parallel.runtime.ParallelRuntime` takes from it the head spans and, per sequence, the
  token spans its wrappers and collectives use;
- tensor mode takes each rank's shards from it (`RankPlan.tensor`): QKV rows, attention-out
  columns, FC1 rows, FC2 columns. Nothing recomputes a split;
- its `weights` say what each rank holds of the checkpoint (the memory check before a run uses it).

`h3 plan` prints this object, a run's report carries it as `partition`, and each rank's report
records the spans and shards it actually used (`RankUsage`), so the three can be compared.

The plan describes ONE group of ranks that share a sequence or the weights (`world_size` of them:
the layout's degree). How the run's ranks form such groups (replicas x CFG halves x degree) is its
`layout` (`h3core.parallel.layout.RankLayout`); every group runs this same partition, and each
rank's runtime is given its own group's process group.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from pydantic import BaseModel, ConfigDict, Field, model_validator

from h3core import settings
from h3core.errors import PartitionError
from h3core.model.config import ModelConfig, preset
from h3core.model.sequence import Segment
from h3core.parallel import partition
from h3core.parallel.decoded import DecodedWeights
from h3core.parallel.overlap import UlyssesOverlap
from h3core.parallel.layout import SEQUENCE_NAMES, RankLayout
from h3core.parallel.modes import BlockShape, Mode, mode_of
from h3core.parallel.modes.tensor_shards import TensorShards, tensor_parallel_prefixes
from h3core.span import Span

if TYPE_CHECKING:
    from h3core.model.checkpoint import TensorSpec


class RankPlan(BaseModel):
    """One rank's share of the run (its token rows and segments are those of the prompt's sequence)."""

    model_config = ConfigDict(frozen=True)
    rank: int
    heads: Span
    tokens: Span
    segments: list[Segment] = Field(description="This rank's segments, clipped to its token interval and rebased to local rows.")
    tensor: TensorShards | None = None


class SequencePlan(BaseModel):
    """One packed sequence of the run, and how its tokens split over the ranks."""

    model_config = ConfigDict(frozen=True)
    name: str = Field(description="'prompt' or 'negative prompt'.")
    segments: list[Segment]
    num_tokens: int
    tokens: list[Span] = Field(description="Token rows of each rank, in rank order.")


class WeightBytes(BaseModel):
    """Checkpoint bytes of a model, and what each rank of a plan holds of them."""

    model_config = ConfigDict(frozen=True)
    parameters: int = Field(description="Weights (NVFP4 elements + dense values).")
    checkpoint_bytes: int = Field(description="Tensor bytes of the checkpoint as stored (NVFP4 codes, scales and markers; dense tensors at their stored dtype).")
    nvfp4_bytes: int = Field(description="Bytes of the NVFP4 linears (codes, scales, global scales, markers).")
    block_linears_bytes: int = Field(description="The per-block qkv_proj/out_proj/fc1/fc2: what tensor mode splits.")
    per_rank: list[int] = Field(description="Stored bytes each rank holds: all of it in Ulysses mode; replicated parts + its shards in tensor mode.")
    dense16_per_rank: list[int] = Field(default_factory=list, description="Of those, the 16-bit dense tensors: they load at the compute dtype (twice as large in fp32).")


class ParallelPlan(BaseModel):
    model_config = ConfigDict(frozen=True)
    mode: Mode
    world_size: int = Field(description="Ranks of one group that share a sequence (the layout's degree); the run's world is `layout.world_size`.")
    preset: str
    num_heads: int
    head_dim: int
    ffn_dim: int
    num_tokens: int = Field(description="Tokens of the prompt's sequence.")
    segments: list[Segment] = Field(description="The prompt's packed sequence.")
    heads: list[int] = Field(description="Heads per rank.")
    tokens: list[int] = Field(description="Tokens per rank (the prompt's sequence).")
    ranks: list[RankPlan]
    weights: WeightBytes | None = None
    sequences: list[SequencePlan] = Field(default_factory=list, description="Every packed sequence of the run: the prompt's, then guidance's negative prompt's.")
    layout: RankLayout = Field(description="How the run's ranks form groups of `world_size`: replicas x CFG halves x degree, and the groups.")
    decoded: DecodedWeights | None = Field(None, description="Where NVFP4 linears decode every forward (Hopper, the CPU): whether they are held decoded once, and the bytes (h3core.parallel.decoded).")
    overlap: UlyssesOverlap | None = Field(None, description="Ulysses mode: the head groups each all-to-all is split into to overlap it with attention, and why (h3core.parallel.overlap).")

    @model_validator(mode="before")
    @classmethod
    def _one_group_by_default(cls, data: object) -> object:
        """A plan without a layout (built for one group, or read from a report written before
        layouts existed) is one group: the world is its ranks."""
        if isinstance(data, dict) and data.get("layout") is None and "world_size" in data:
            guided = len(data.get("sequences") or []) > 1
            data = {**data, "layout": RankLayout(degree=data["world_size"], guided=guided)}
        return data

    @classmethod
    def for_layout(cls, config: ModelConfig, layout: RankLayout, mode: Mode, *sequences: list[Segment], specs: Sequence["TensorSpec"] | None = None) -> "ParallelPlan":
        """The plan of a run laid out as `layout`: the partition of one group of `layout.degree` ranks
        (a `PartitionError` then names the layout: the count it speaks of is one group's)."""
        try:
            plan = cls.build(config, layout.degree, mode, *sequences, specs=specs)
        except PartitionError as err:
            if layout.degree == layout.world_size:
                raise
            raise PartitionError(f"{err} per group ({layout.describe()})") from err
        return plan.model_copy(update={"layout": layout})

    @classmethod
    def build(cls, config: ModelConfig, world_size: int, mode: Mode, *sequences: list[Segment], specs: Sequence["TensorSpec"] | None = None) -> "ParallelPlan":
        """Apply the partition contract to each of the run's `sequences` (the prompt's first) for one
        group of `world_size` ranks; raise `PartitionError` for any empty or misaligned part. `specs`:
        the checkpoint's tensors (default: the synthetic layout of `config`, which is the seed's file's)."""
        heads = partition.head_spans(config.num_heads, world_size)
        splits = [_sequence_plan(name, segments, world_size) for name, segments in zip(SEQUENCE_NAMES, sequences)]
        shards = mode_of(mode).shards(config, heads)
        prompt = splits[0]
        ranks = [
            RankPlan(rank=r, heads=heads[r], tokens=prompt.tokens[r], segments=partition.clip_segments(prompt.segments, prompt.tokens[r]), tensor=shards[r])
            for r in range(world_size)
        ]
        return cls(
            mode=mode, world_size=world_size, preset=config.name, num_heads=config.num_heads, head_dim=config.head_dim,
            ffn_dim=config.ffn_dim, num_tokens=prompt.num_tokens, segments=prompt.segments,
            heads=[len(h) for h in heads], tokens=[len(t) for t in prompt.tokens], ranks=ranks,
            weights=weight_bytes(config, mode, ranks, specs), sequences=splits,
        )

    @classmethod
    def for_preset(cls, name: str, count: int | None, mode: Mode, *, width: int | None = None, height: int | None = None,
                   frames: int | None = None, text_tokens: int | None = None, cfg_parallel: bool = False, replicas: int = 1,
                   keyframes: int = 0, text_tags: list[int] | None = None) -> "ParallelPlan":
        """`h3 plan`: the plan of preset `name` at `count` ranks (None: H3_WORLD_SIZE, else every
        visible GPU, else 1) for a prompt of `text_tokens` tokens (None: the preset's), laid out as
        `replicas` groups (of two CFG halves with `cfg_parallel`: the layout then assumes guidance);
        with `keyframes` condition frames and the text as presented with them (`text_tags`, each row's
        tag: then its length is the text's)."""
        from h3core.runtime.device import visible_gpu_count

        cfg = preset(name)
        size = settings.SizeFlags(width=width, height=height, frames=frames)  # a bad value is h3 generate's one line
        tokens = len(text_tags) if text_tags is not None else cfg.text_tokens if text_tokens is None else text_tokens
        segments = cfg.segments(*size.or_defaults(cfg.width, cfg.height, cfg.frames), tokens, keyframes=keyframes, text_tags=text_tags)
        world = settings.world_size(count, visible_gpu_count)
        layout = RankLayout.of(world, cfg_parallel=cfg_parallel, replicas=replicas, guided=cfg_parallel)
        return cls.for_layout(cfg, layout, mode, segments)

    @property
    def head_spans(self) -> list[Span]:
        return [r.heads for r in self.ranks]

    def block_shape(self, tokens: int) -> BlockShape:
        """What one block's working set depends on, on this plan's largest rank (`tokens`: rows of the
        longest sequence the run gives a forward)."""
        local = max(len(t) for seq in self.sequences for t in seq.tokens)
        overlapped = self.overlap is not None and self.overlap.on
        return BlockShape(tokens=tokens, local_tokens=local, local_heads=max(self.heads), world_size=self.world_size, overlapped=overlapped)


def _sequence_plan(name: str, segments: list[Segment], world_size: int) -> SequencePlan:
    num_tokens = segments[-1].stop if segments else 0
    return SequencePlan(name=name, segments=segments, num_tokens=num_tokens, tokens=partition.token_spans(num_tokens, world_size))


# --- what each rank holds of the checkpoint -----------------------------------------------------------


def weight_bytes(config: ModelConfig, mode: Mode, ranks: Sequence[RankPlan], specs: Sequence["TensorSpec"] | None = None) -> WeightBytes:
    """The checkpoint's stored bytes (`specs`, default the synthetic = seed layout of `config`) and what
    each rank holds of them (the mode's `weights_per_rank`)."""
    if specs is None:
        from h3core.model.synthetic import synthetic_specs

        specs = synthetic_specs(config)
    split = tensor_parallel_prefixes(config.num_blocks)
    nvfp4 = {s.prefix for s in specs if s.name.endswith(".weight_scale")}
    held = mode_of(mode).weights_per_rank(specs, [r.tensor for r in ranks], config)
    return WeightBytes(
        parameters=sum(s.parameters for s in specs),
        checkpoint_bytes=sum(s.nbytes for s in specs),
        nvfp4_bytes=sum(s.nbytes for s in specs if s.prefix in nvfp4),
        block_linears_bytes=sum(s.nbytes for s in specs if s.name.startswith(split)),
        per_rank=[h for h, _ in held],
        dense16_per_rank=[d for _, d in held],
    )
