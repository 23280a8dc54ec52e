"""How a prompt with keyframes is presented to the text encoder (MINIMAX_H3.md 4.2; diffusers 0.42.1
`MiniMaxH3FL2VATextEncoderStep`): for each image in packed order the label `"<Picture i>: "`
(tokenized as text, tag 1), then its vision block `<|vision_start|>`, K x `<|image_pad|>`,
`<|vision_end|>` (tag 0: the transformer modulates these rows as video); then the prompt verbatim
(tag 1). K is the image's merged token count (`ImageProcessor.image_tokens`). Without images it is
the prompt's own tokens, all tag 1. No template, no special tokens added, nothing cut.

This needs only the tokenizer and the images' sizes, so the launcher can count a request's rows
before any weight is read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from h3core.errors import CheckpointError
from h3core.text.tokenizer import PromptTokenizer

VISION_START, IMAGE_PAD, VISION_END = "<|vision_start|>", "<|image_pad|>", "<|vision_end|>"
"""Qwen3-VL's vision-block tokens (151652, 151655, 151653 in H3's tokenizer)."""

TEXT_TAG, VISION_TAG = 1, 0
"""MiniMax-H3's per-row modality tags of the text rows: text, and a vision block (tagged as video)."""


@dataclass(frozen=True)
class Presentation:
    """The token ids of a presentation, their tags, and where each image's pad tokens are."""

    token_ids: list[int]
    tags: list[int]
    image_spans: list[range]
    """Per image, the positions of its `<|image_pad|>` tokens (K of them, contiguous)."""


def picture_label(index: int) -> str:
    """The label before the `index`-th (0-based) image: `"<Picture 1>: "`, ..."""
    return f"<Picture {index + 1}>: "


def present(tokenizer: PromptTokenizer, prompt: str, image_tokens: Sequence[int] = ()) -> Presentation:
    """The presentation of `prompt` after images of `image_tokens[i]` pad tokens each."""
    start, pad, end = (vision_token_id(tokenizer, token) for token in (VISION_START, IMAGE_PAD, VISION_END)) if image_tokens else (0, 0, 0)
    ids: list[int] = []
    tags: list[int] = []
    spans: list[range] = []
    for index, count in enumerate(image_tokens):
        label = tokenizer.encode(picture_label(index))
        ids += label + [start] + [pad] * count + [end]
        tags += [TEXT_TAG] * len(label) + [VISION_TAG] * (count + 2)
        spans.append(range(len(ids) - 1 - count, len(ids) - 1))
    text = tokenizer.encode(prompt)
    return Presentation(ids + text, tags + [TEXT_TAG] * len(text), spans)


def vision_token_id(tokenizer: PromptTokenizer, token: str) -> int:
    """The id of a vision-block token; a `CheckpointError` when the tokenizer does not have it."""
    token_id = tokenizer.token_id(token)
    if token_id is None:
        raise CheckpointError(
            f"tokenizer {tokenizer.name} has no {token} token: it is not Qwen3-VL's, so it cannot present keyframes; "
            "use the text encoder's own tokenizer"
        )
    return token_id
