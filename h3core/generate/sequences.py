"""A request's packed sequences on one rank: the prompt's (and guidance's negative prompt's) refined
text rows with their plan and RoPE table, this rank's rows of them, and the seeded noise.

The token refiner depends on the text only, so each sequence's text rows are refined once per
request (`H3Model.refine_text`, on every rank: two blocks over the L text rows, against fifty over
the whole sequence per step), and every forward takes its rows of them. Noise depends only on the
seed and the shapes (`h3core.model.sampler.initial_noise`), so every rank draws the same whole
latent and keeps its own rows: the latent state stays token-sharded for the whole loop.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from h3core.generate.instruments import HostValues, on_host
from h3core.generate.request import RunShape
from h3core.model.dit import H3Model, PackedSequence, Rope, rope_table
from h3core.model.positions import position_ids
from h3core.model.sampler import initial_noise
from h3core.model.sequence import LATENT_KINDS, Segment, SegmentKind
from h3core.parallel import partition
from h3core.parallel.plan import SequencePlan
from h3core.span import Span

Latent = dict[SegmentKind, torch.Tensor]
"""Latent rows by kind (video, audio): the whole latent, or one rank's rows of it."""


@dataclass
class Sequence:
    """One packed sequence of a request on one rank: its plan, refined text rows and RoPE table."""

    plan: SequencePlan
    text: torch.Tensor  # [L, D]: the refined text rows
    rope: Rope

    @property
    def segments(self) -> list[Segment]:
        return self.plan.segments

    def kind_spans(self, kind: SegmentKind) -> list[Span]:
        """Per rank, the rows of `kind`'s segment it holds, in that segment's own coordinates."""
        return partition.kind_spans(self.plan.segments, self.plan.tokens, kind)

    def local_inputs(self, rank: int, latent: Latent) -> PackedSequence:
        """The model input for `rank`'s rows: its text rows, the given latent rows, the RoPE table."""
        rows = self.plan.tokens[rank]
        features = dict(latent)
        text = partition.kind_rows(self.plan.segments, rows).get(SegmentKind.TEXT)
        if text is not None:
            features[SegmentKind.TEXT] = self.text[text.start : text.stop]
        return PackedSequence(segments=partition.clip_segments(self.plan.segments, rows), features=features, rope=self.rope.select(rows))


def build_sequence(model: H3Model, plan: SequencePlan, states: torch.Tensor, shape: RunShape, device: torch.device,
                   host: "HostValues" = on_host) -> Sequence:
    """The sequence of `plan` with its text encoder states (whose length must be the plan's), refined, on
    `device`; its positions computed by `host` (host arithmetic: `h3core.generate.instruments`)."""
    planned = sum(len(s) for s in plan.segments if s.kind is SegmentKind.TEXT)
    if states.shape[0] != planned:
        raise RuntimeError(f"the {plan.name} encodes to {states.shape[0]} tokens but the plan has {planned}: the tokenizer changed between resolve and encode")
    rope = rope_table(model.config, host(position_ids, plan.segments, shape)).to(device)
    text = model.refine_text(states.to(device)) if planned else states.new_zeros(0, model.config.hidden).to(device, model.dtype)
    return Sequence(plan=plan, text=text, rope=rope)


def latent_kinds(segments: list[Segment]) -> list[SegmentKind]:
    """The latent kinds a sequence carries, in order (video, audio)."""
    return [k for k in LATENT_KINDS if any(seg.kind is k for seg in segments)]


def noise_rows(shape: RunShape, seed: int) -> Latent:
    """Seeded noise as packed rows: {video: [Nv, 96], audio: [2 T_a, 32]}, float32, identical on every rank."""
    return initial_noise(seed, shape)
