"""The packed sequence's layout (../shared/MINIMAX_H3.md §2): `text | condition | audio | video`
rows, no padding.

A segment is a run of rows `[start, stop)` of one kind. Its kind decides three things the model
reads per row (§2.3):

| kind      | features from                 | AdaLN modality tag | timestep (clock)      | output head |
|-----------|-------------------------------|--------------------|-----------------------|-------------|
| text      | the refined text              | 1                  | the video's           | none        |
| condition | keyframe latent rows (noised) | 0                  | max(video's, 0.999)   | none        |
| audio     | audio latent rows             | 2                  | the audio's           | `audio_out` |
| video     | video latent rows             | 0                  | the video's           | `video_out` |

Condition rows (FL2VA) are one latent frame per keyframe, first then last, projected like video
rows (`video_patch_proj`) but never stepped: their outputs are never computed. They are ordinary
rows for the partition (token ranges, clipping), so every mode and count takes them as it is.

A segment can override its tag and clock (`Segment.tag`, `Segment.clock`): the diffusers-style
entry point builds segments from arbitrary per-row tags and timestep indices that way, and the
vision tokens of a keyframe inside the text (tag 0, `ModelConfig.segments(text_tags=...)`) are
text segments with tag 0. A kind's segments are contiguous (text may be several segments, one per
run of equal tags): `partition.kind_rows` numbers a kind's rows across them.

Pure Python (no torch): the model config, the partition and `h3 plan` speak it before anything
heavy is imported. `Segment` is a frozen dataclass: plans and reports serialise it as
`{"kind", "start", "stop", "tag", "clock"}`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from h3core.span import Span


class SegmentKind(str, Enum):
    TEXT = "text"
    CONDITION = "condition"
    AUDIO = "audio"
    VIDEO = "video"

    def __str__(self) -> str:  # 'text' in messages and tables, as the value reports carry
        return self.value


VIDEO_TAG, TEXT_TAG, AUDIO_TAG = 0, 1, 2
"""AdaLN modality tags (diffusers' `token_tags`): the table row of a row is `tidx * 3 + tag`."""

MODALITIES = 3
"""Tags per timestep in the AdaLN tables."""

VIDEO_CLOCK, AUDIO_CLOCK, CONDITION_CLOCK = "video", "audio", "condition"
"""The noise levels of a step: text and video rows run at the video's, audio at its own, keyframe
condition rows at `max(video's, CONDITION_LEVEL)`."""

CONDITION_LEVEL = 0.999
"""The timestep keyframe condition rows are noised to once (`c = 0.999 z + 0.001 e`) and held at
while the video's is below it (diffusers' `keyframe_noise_aug`, SGLang's imgvid condition timestep)."""

_DEFAULTS = {
    SegmentKind.TEXT: (TEXT_TAG, VIDEO_CLOCK),
    SegmentKind.CONDITION: (VIDEO_TAG, CONDITION_CLOCK),
    SegmentKind.AUDIO: (AUDIO_TAG, AUDIO_CLOCK),
    SegmentKind.VIDEO: (VIDEO_TAG, VIDEO_CLOCK),
}


@dataclass(frozen=True)
class Segment:
    """`kind` rows `[start, stop)` of a packed sequence, at AdaLN tag `tag` and timestep `clock`."""

    kind: SegmentKind
    start: int
    stop: int
    tag: int = field(default=-1)
    clock: str = field(default="")

    def __post_init__(self) -> None:
        kind = SegmentKind(self.kind)
        object.__setattr__(self, "kind", kind)
        tag, clock = _DEFAULTS[kind]
        if self.tag == -1:
            object.__setattr__(self, "tag", tag)
        if not self.clock:
            object.__setattr__(self, "clock", clock)
        if not 0 <= self.start <= self.stop:
            raise ValueError(f"invalid segment [{self.start}, {self.stop})")

    def __len__(self) -> int:
        return self.stop - self.start

    @property
    def span(self) -> Span:
        return Span(self.start, self.stop)

    def moved(self, start: int, stop: int) -> "Segment":
        """The same kind, tag and clock over other rows."""
        return Segment(self.kind, start, stop, self.tag, self.clock)


def pack_segments(lengths: list[tuple[SegmentKind, int]]) -> list[Segment]:
    """Lay segments back to back in the given order, with no padding; empty ones are dropped."""
    segments, start = [], 0
    for kind, length in lengths:
        if length < 0:
            raise ValueError(f"negative segment length {length} for {kind.value}")
        if length:
            segments.append(Segment(kind, start, start + length))
            start += length
    return segments


def kind_length(segments: list[Segment], kind: SegmentKind) -> int:
    """Rows of `kind` in the sequence."""
    return sum(len(seg) for seg in segments if seg.kind is kind)


def tag_runs(tags: list[int]) -> list[tuple[int, int]]:
    """`(length, tag)` of each run of equal tags, in order: [1, 1, 0, 0, 0, 1] -> [(2, 1), (3, 0), (1, 1)]."""
    runs: list[tuple[int, int]] = []
    for tag in tags:
        if runs and runs[-1][1] == tag:
            runs[-1] = (runs[-1][0] + 1, tag)
        else:
            runs.append((1, tag))
    return runs


def kind_span(segments: list[Segment], kind: SegmentKind) -> Span | None:
    """The rows of `kind` in the sequence (its segments are contiguous), or None if it has none."""
    mine = [seg for seg in segments if seg.kind is kind]
    if not mine:
        return None
    span = Span(mine[0].start, mine[-1].stop)
    assert len(span) == sum(len(seg) for seg in mine), f"the {kind} segments are not contiguous"
    return span


KINDS = (SegmentKind.TEXT, SegmentKind.CONDITION, SegmentKind.AUDIO, SegmentKind.VIDEO)
LATENT_KINDS = (SegmentKind.VIDEO, SegmentKind.AUDIO)
"""The kinds the sampler steps (each on its own schedule), in the order reports and files list them."""
