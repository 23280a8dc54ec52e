"""A request's packed sequences on one rank: the prompt's (and guidance's negative prompt's) text
hidden states with their plan and RoPE table, this rank's rows of them, and the seeded noise.

Noise depends only on the seed and the shapes (`h3core.model.sampler.initial_noise`), so every rank draws
the same whole latent and keeps its own rows of it: the latent state stays token-sharded, in the
rows the prompt's sequence gives this rank, for the whole loop.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from h3core.generate.request import RunShape
from h3core.model.config import ModelConfig
from h3core.model.dit import PackedSequence, Rope, patchify_audio, patchify_video, rope_table, token_positions
from h3core.model.sampler import initial_noise
from h3core.model.sequence import LATENT_KINDS, Segment, SegmentKind
from h3core.parallel import partition
from h3core.parallel.plan import SequencePlan
from h3core.span import Span

Latent = dict[SegmentKind, torch.Tensor]
"""Latent patch tokens by kind (video, audio): the whole latent, or one rank's rows of it."""


@dataclass
class Sequence:
    """One packed sequence of a request on one rank: its plan, text hidden states and RoPE table."""

    plan: SequencePlan
    text: torch.Tensor  # [L, text_dim]
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


def build_sequence(config: ModelConfig, plan: SequencePlan, text: torch.Tensor, video_grid: tuple[int, int, int], device: torch.device) -> Sequence:
    """The sequence of `plan` with its text hidden states (whose length must be the plan's) on `device`."""
    planned = sum(len(s) for s in plan.segments if s.kind is SegmentKind.TEXT)
    if text.shape[0] != planned:
        raise RuntimeError(f"the {plan.name} encodes to {text.shape[0]} tokens but the plan has {planned}: the tokenizer changed between resolve and encode")
    rope = rope_table(config, token_positions(plan.segments, video_grid)).to(device)
    return Sequence(plan=plan, text=text.to(device), rope=rope)


def latent_kinds(segments: list[Segment]) -> list[SegmentKind]:
    """The latent kinds a sequence carries, in order (video, audio)."""
    return [k for k in LATENT_KINDS if any(seg.kind is k for seg in segments)]


def noise_tokens(config: ModelConfig, shape: RunShape, seed: int) -> Latent:
    """Seeded noise as patch tokens: {video: [Nv, Pv], audio: [Na, Pa]}, float32, identical on every rank."""
    noise = initial_noise(seed, {"video": shape.video_latent, "audio": shape.audio_latent})
    return {
        SegmentKind.VIDEO: patchify_video(noise["video"], config.video_patch),
        SegmentKind.AUDIO: patchify_audio(noise["audio"], config.audio_patch),
    }
