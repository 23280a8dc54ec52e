"""A request's packed sequences on one rank: the prompt's (and guidance's negative prompt's) refined
text rows with their plan and RoPE table, the keyframes' noised condition rows, this rank's rows of
them, and the seeded noise.

The token refiner depends on the text only, so each sequence's text rows are refined once per
request (`H3Model.refine_text`, on every rank: two blocks over the L text rows, against fifty over
the whole sequence per step), and every forward takes its rows of them. Noise depends only on the
seed and the shapes (`h3core.model.sampler.initial_noise`, in the request's noise recipe), so every
rank draws the same whole latent and keeps its own rows: the latent state stays token-sharded for
the whole loop. Keyframe condition rows (FL2VA) are the keyframes' clean latents (rank 0 encoded
them; every rank got them by broadcast) noised once with the recipe's condition noise: the same
rows on every rank, of which each rank feeds its own to the model, as it does with the text.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from h3core.generate.instruments import HostValues, on_host
from h3core.generate.request import RunShape
from h3core.model.dit import H3Model, PackedSequence, Rope, rope_table
from h3core.model.positions import position_ids
from h3core.model.sampler import NoiseRecipe, initial_noise, noised_condition
from h3core.model.sequence import LATENT_KINDS, Segment, SegmentKind
from h3core.parallel import partition
from h3core.parallel.plan import SequencePlan
from h3core.span import Span

Latent = dict[SegmentKind, torch.Tensor]
"""Latent rows by kind (video, audio): the whole latent, or one rank's rows of it."""


@dataclass
class Conditioning:
    """What one request's sequences are conditioned on, as rank 0's encoders made it (CPU, float32):
    per sequence (the prompt's, then the negative prompt's) the text encoder's states `[L, text_dim]`
    (their rows' tags were checked against the plan on rank 0: `check_text_tags`); with keyframes
    their clean normalized latents `[24, n, H/16, W/16]` (the VAE's encoder), shared by every sequence."""

    states: list[torch.Tensor]
    keyframes: torch.Tensor | None = None

    def tensors(self) -> list[torch.Tensor]:
        """Flat, for one broadcast: the states, then the keyframe latents (if any)."""
        return [*self.states] + ([self.keyframes] if self.keyframes is not None else [])

    @classmethod
    def of_tensors(cls, tensors: list[torch.Tensor], sequences: int, keyframes: bool) -> "Conditioning":
        """The inverse of `tensors` for a request of `sequences` sequences, with or without keyframes."""
        assert len(tensors) == sequences + int(keyframes), "a request's conditioning is one tensor per sequence (+ the keyframes)"
        return cls(list(tensors[:sequences]), tensors[-1] if keyframes else None)


def check_text_tags(plan: SequencePlan, tags: torch.Tensor) -> None:
    """The text encoder tagged the rows of `plan`'s text as the plan did (vision blocks 0, text 1): a
    RuntimeError otherwise (rank 0, on the CPU, before anything is broadcast)."""
    planned = [s.tag for s in plan.segments if s.kind is SegmentKind.TEXT for _ in range(len(s))]
    if tags.tolist() != planned:
        raise RuntimeError(
            f"the {plan.name}'s text encoder gave {tags.numel()} rows tagged otherwise than the plan's {len(planned)} "
            "(vision blocks 0, text 1): the presentation changed between resolve and encode"
        )


@dataclass
class Sequence:
    """One packed sequence of a request on one rank: its plan, refined text rows and RoPE table."""

    plan: SequencePlan
    text: torch.Tensor  # [L, D]: the refined text rows
    rope: Rope
    condition: torch.Tensor | None = None  # [n * h * w, 96] float32: the keyframes' noised condition rows (FL2VA)

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
        held = partition.kind_rows(self.plan.segments, rows)
        for kind, whole in ((SegmentKind.TEXT, self.text), (SegmentKind.CONDITION, self.condition)):
            if kind in held:
                assert whole is not None, f"the plan has {kind} rows the sequence was not given"
                features[kind] = whole[held[kind].start : held[kind].stop]
        return PackedSequence(segments=partition.clip_segments(self.plan.segments, rows), features=features, rope=self.rope.select(rows))


def build_sequence(model: H3Model, plan: SequencePlan, states: torch.Tensor, shape: RunShape, device: torch.device,
                   condition: torch.Tensor | None = None, host: "HostValues" = on_host) -> Sequence:
    """The sequence of `plan` with its text encoder states (whose length must be the plan's), refined, on
    `device`; `condition`: the keyframes' noised condition rows `[n * h * w, 96]` (`condition_rows`),
    as many as the plan has; its positions computed by `host` (host arithmetic:
    `h3core.generate.instruments`)."""
    text = [s for s in plan.segments if s.kind is SegmentKind.TEXT]
    planned = sum(len(s) for s in text)
    if states.shape[0] != planned:
        raise RuntimeError(f"the {plan.name} encodes to {states.shape[0]} tokens but the plan has {planned}: the tokenizer changed between resolve and encode")
    conditions = sum(len(s) for s in plan.segments if s.kind is SegmentKind.CONDITION)
    if conditions != (0 if condition is None else condition.shape[0]):
        raise RuntimeError(f"the {plan.name} has {conditions} keyframe condition rows, given {0 if condition is None else condition.shape[0]}")
    rope = rope_table(model.config, host(position_ids, plan.segments, shape)).to(device)
    refined = model.refine_text(states.to(device)) if planned else states.new_zeros(0, model.config.hidden).to(device, model.dtype)
    return Sequence(plan=plan, text=refined, rope=rope, condition=None if condition is None else condition.to(device))


def latent_kinds(segments: list[Segment]) -> list[SegmentKind]:
    """The latent kinds a sequence carries, in order (video, audio)."""
    return [k for k in LATENT_KINDS if any(seg.kind is k for seg in segments)]


def noise_rows(shape: RunShape, seed: int, recipe: NoiseRecipe | str = NoiseRecipe.OFFICIAL) -> Latent:
    """Seeded noise as packed rows: {video: [Nv, 96], audio: [2 T_a, 32]} (with keyframes also
    {condition: [n h w, 96]}), float32, identical on every rank."""
    return initial_noise(seed, shape, recipe)


def condition_rows(clean: torch.Tensor, noise: torch.Tensor, shape: RunShape) -> torch.Tensor:
    """The keyframes' condition rows: their clean normalized latents `[24, n, H/16, W/16]` patchified in
    packed order (first, then last) and noised once with `noise` `[n h w, 96]` (`noised_condition`)."""
    from h3core.model.dit import patchify_video

    return noised_condition(patchify_video(clean.float(), shape.patch), noise)
