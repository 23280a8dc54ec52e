"""The prompt presentation with keyframes (MINIMAX_H3.md 4.2): label, vision block, prompt, and tags;
and `encode_prompt` without images is `encode` with all-ones tags."""

from __future__ import annotations

import torch

from h3core.text import load_text_encoder
from h3core.text.presentation import IMAGE_PAD, VISION_END, VISION_START, present
from h3core.text.tokenizer import shipped_tokenizer

PROMPT = "a red fox <d>[English] Look!</d> 雪"


def test_presentation_of_two_images_follows_diffusers_fl2va_step():
    """The ids and tags diffusers' MiniMaxH3FL2VATextEncoderStep builds, with transformers' tokenizer."""
    from transformers import AutoTokenizer

    from h3core.text.tokenizer import SHIPPED_FOLDER

    reference = AutoTokenizer.from_pretrained(str(SHIPPED_FOLDER))
    counts = [6, 15]
    expected_ids, expected_tags = [], []
    for index, count in enumerate(counts):
        label = reference(f"<Picture {index + 1}>: ", add_special_tokens=False)["input_ids"]
        block = [reference.convert_tokens_to_ids(t) for t in (VISION_START,)] + [reference.convert_tokens_to_ids(IMAGE_PAD)] * count
        block += [reference.convert_tokens_to_ids(VISION_END)]
        expected_ids += label + block
        expected_tags += [1] * len(label) + [0] * len(block)
    text = reference(PROMPT, add_special_tokens=False)["input_ids"]
    presentation = present(shipped_tokenizer(), PROMPT, counts)
    assert presentation.token_ids == expected_ids + text and presentation.tags == expected_tags + [1] * len(text)
    assert [presentation.token_ids[i] for span in presentation.image_spans for i in span] == [151655] * sum(counts)
    assert [len(span) for span in presentation.image_spans] == counts
    assert expected_ids[presentation.image_spans[0].start - 1] == 151652 and expected_ids[presentation.image_spans[0].stop] == 151653


def test_without_images_the_presentation_is_the_prompt():
    presentation = present(shipped_tokenizer(), PROMPT)
    assert presentation.token_ids == shipped_tokenizer().encode(PROMPT) and set(presentation.tags) == {1}
    assert presentation.image_spans == []


def test_encode_prompt_without_images_is_encode(tmp_path, monkeypatch):
    monkeypatch.setenv("H3_CACHE_DIR", str(tmp_path))
    encoder = load_text_encoder(None, hidden_size=64)
    states, tags = encoder.encode_prompt(PROMPT)
    assert states.dtype == encoder.dtype and torch.equal(states.float(), encoder.encode(PROMPT))
    assert tags.dtype == torch.int64 and torch.equal(tags, torch.ones(states.shape[0], dtype=torch.int64))
    empty, empty_tags = encoder.encode_prompt("")
    assert empty.shape == (0, 64) and empty_tags.shape == (0,)
