"""Prompt tokenizers: a `tokenizer.json` read with the `tokenizers` package, or the byte-level
tokenizer of the synthetic encoder (one token per UTF-8 byte, ids 0..255)."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from h3core.errors import CheckpointError

TOKENIZER_FILE = "tokenizer.json"
"""The file h3 looks for beside a text-encoder checkpoint."""

BYTE_LEVEL = "byte-level"


class PromptTokenizer(Protocol):
    name: str
    """The tokenizer file, or "byte-level"."""

    def encode(self, text: str) -> list[int]: ...


class ByteTokenizer:
    """UTF-8 bytes as token ids (vocabulary 256): no file, no merges, never unknown."""

    name = BYTE_LEVEL
    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))


class FileTokenizer:
    """A Hugging Face `tokenizer.json`. Ids are what the file's pipeline produces, special tokens
    included where its post-processor adds them (Qwen's adds none)."""

    def __init__(self, path: Path):
        from tokenizers import Tokenizer

        if not path.is_file():
            raise CheckpointError(
                f"text encoder tokenizer not found: looked for {path}; put the model's "
                f"{TOKENIZER_FILE} beside its weights"
            )
        try:
            self._tokenizer = Tokenizer.from_file(str(path))
        except Exception as exc:  # the Rust side raises bare Exceptions on a malformed file
            raise CheckpointError(f"cannot read tokenizer {path}: {' '.join(str(exc).split())}") from None
        self.name = str(path)

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text).ids
