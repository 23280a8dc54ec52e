"""What a prompt is, for `--prompt` and every prompt of `--prompts` alike: text with something in it.

An empty or blank prompt encodes to no text rows (or to whitespace alone): the model is then
conditioned on nothing, which no one asks for on purpose, so it is refused in one line wherever it
comes from. (A negative prompt may be empty: that is guidance's unconditional branch.)
"""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator
from pydantic_core import PydanticCustomError


def _not_blank(text: str) -> str:
    if not text.strip():
        raise PydanticCustomError("blank_prompt", "is empty or only whitespace; give a prompt with some text in it")
    return text


PromptText = Annotated[str, AfterValidator(_not_blank)]
"""A prompt: a string that is not empty or only whitespace."""
