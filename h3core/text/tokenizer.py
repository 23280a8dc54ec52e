"""The prompt tokenizer: Qwen's byte-level BPE with H3's added special tokens, built with `tokenizers`.

H3 tokenizes the prompt as is: no chat template, no special tokens added around it (diffusers
0.42.1 `minimax_h3/encoders.py`: `tokenizer(prompt, add_special_tokens=False)`). Its tokenizer is
Qwen3-VL's vocabulary (151,643 BPE entries) plus added tokens: Qwen's 26 at ids 151643-151668 and
H3's 7 (`<d>`, `</d>`, `<|cutoff|>`, `<|lyrics_start|>`, `<|lyrics_end|>`, `<|caption_start|>`,
`<|caption_end|>`) at 151669-151675, each matched whole before BPE. H3's repository declares
those 7 only in `tokenizer_config.json` (`additional_special_tokens`), so they are appended after
the ids the config lists, in order, as transformers does when it loads the folder.

Where the files come from (`tokenizer_for`):

- a folder checkpoint: its own tokenizer (`tokenizer.json`, or `vocab.json` + `merges.txt`, with
  `tokenizer_config.json`'s added tokens), found in the folder or its sibling `tokenizer/`;
- a single file (ComfyUI's carries none) and the synthetic encoder: the copy h3 ships in
  `h3_tokenizer/` (provenance and license in `h3_tokenizer/README.md`).

The pipeline built from `vocab.json` + `merges.txt` is transformers' `Qwen2Tokenizer`'s: NFC,
Qwen's pre-tokenizer split, byte-level, BPE without unknown token or byte fallback. A test holds
the ids equal to transformers' tokenizer on prompts with dialogue markers and non-ASCII text.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Protocol

from h3core.errors import CheckpointError

SHIPPED_FOLDER = Path(__file__).parent / "h3_tokenizer"
"""H3's tokenizer as h3 ships it: Qwen's vocab.json and merges.txt, and H3's added tokens."""

SHIPPED_NAME = "h3 (shipped: Qwen3-VL vocabulary + H3 tokens)"

TOKENIZER_JSON, VOCAB, MERGES, CONFIG = "tokenizer.json", "vocab.json", "merges.txt", "tokenizer_config.json"

TOKENIZER_FOLDER = "tokenizer"
"""The sibling folder the official layout keeps the tokenizer in (`FL2VA/tokenizer/`)."""

QWEN_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
"""How Qwen's tokenizers split text before byte-level BPE (transformers `tokenization_qwen2.py`)."""


class PromptTokenizer(Protocol):
    name: str
    """Where the tokenizer came from (a folder, or the shipped copy)."""

    vocab_size: int
    """Ids it can produce are `0 .. vocab_size - 1` (added tokens included)."""

    def encode(self, text: str) -> list[int]: ...

    def token_id(self, token: str) -> int | None:
        """The id of an added token (`<|image_pad|>`), None when the vocabulary lacks it."""
        ...


class QwenTokenizer:
    """A `tokenizers.Tokenizer` with H3's added tokens; `encode` adds nothing around the text."""

    def __init__(self, tokenizer: Any, name: str):
        self._tokenizer, self.name = tokenizer, name
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def token_id(self, token: str) -> int | None:
        return self._tokenizer.token_to_id(token)


@dataclass(frozen=True)
class TokenizerFiles:
    """A folder holding a tokenizer: `tokenizer.json`, or `vocab.json` + `merges.txt`."""

    folder: Path

    @property
    def has_tokenizer_json(self) -> bool:
        return (self.folder / TOKENIZER_JSON).is_file()

    @classmethod
    def find(cls, folder: Path) -> "TokenizerFiles | None":
        if (folder / TOKENIZER_JSON).is_file() or ((folder / VOCAB).is_file() and (folder / MERGES).is_file()):
            return cls(folder)
        return None


def shipped_tokenizer() -> QwenTokenizer:
    """H3's tokenizer from the copy in the package (built once per process)."""
    return load_tokenizer(SHIPPED_FOLDER, SHIPPED_NAME)


def folder_tokenizer(candidates: list[Path], where: Path) -> QwenTokenizer:
    """The tokenizer in the first of `candidates` that holds one; a `CheckpointError` naming them otherwise."""
    for folder in candidates:
        if TokenizerFiles.find(folder) is not None:
            return load_tokenizer(folder, str(folder))
    looked = " and ".join(str(f) for f in candidates)
    raise CheckpointError(
        f"text encoder folder {where} has no tokenizer: looked for {TOKENIZER_JSON} or {VOCAB} + {MERGES} in "
        f"{looked}; copy the model's tokenizer/ folder beside its weights (H3's is FL2VA/tokenizer/)"
    )


@lru_cache(maxsize=8)
def load_tokenizer(folder: Path, name: str) -> QwenTokenizer:
    """The tokenizer in `folder` with the added tokens its `tokenizer_config.json` declares."""
    files = TokenizerFiles(folder)
    try:
        tokenizer = _from_tokenizer_json(folder) if files.has_tokenizer_json else _from_vocab_and_merges(folder)
    except Exception as exc:  # the Rust side raises bare Exceptions on malformed files
        raise CheckpointError(f"cannot read the tokenizer in {folder}: {' '.join(str(exc).split())}") from None
    _add_configured_tokens(tokenizer, _read_config(folder / CONFIG), folder)
    return QwenTokenizer(tokenizer, name)


def _from_tokenizer_json(folder: Path) -> Any:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(folder / TOKENIZER_JSON))


def _from_vocab_and_merges(folder: Path) -> Any:
    from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE

    bpe = BPE.from_file(
        str(folder / VOCAB), str(folder / MERGES), unk_token=None, continuing_subword_prefix="",
        end_of_word_suffix="", fuse_unk=False, byte_fallback=False,
    )
    tokenizer = Tokenizer(bpe)
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _read_config(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"cannot read {path}: {exc}; fix it or take the model's own copy") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{path} is not a JSON object; take the model's own copy")
    return config


def _add_configured_tokens(tokenizer: Any, config: dict[str, Any], folder: Path) -> None:
    """`added_tokens_decoder` at their stated ids, then `additional_special_tokens` not yet known
    appended in order (transformers' rule), each matched whole."""
    from tokenizers import AddedToken

    decoder = config.get("added_tokens_decoder", {})
    for token_id, spec in sorted(decoder.items(), key=lambda item: int(item[0])):
        flags = {k: spec[k] for k in ("single_word", "lstrip", "rstrip", "normalized") if k in spec}
        added = AddedToken(spec["content"], special=bool(spec.get("special", False)), **flags)
        _add(tokenizer, added, int(token_id), folder)
    for content in config.get("additional_special_tokens", []):
        if tokenizer.token_to_id(content) is None:
            _add(tokenizer, AddedToken(content, special=True, normalized=False), None, folder)


def _add(tokenizer: Any, token: Any, token_id: int | None, folder: Path) -> None:
    known = tokenizer.token_to_id(token.content)
    if known is None:
        if token.special:
            tokenizer.add_special_tokens([token])
        else:
            tokenizer.add_tokens([token])
        known = tokenizer.token_to_id(token.content)
    if token_id is not None and known != token_id:
        raise CheckpointError(
            f"{folder / CONFIG} puts {token.content!r} at id {token_id} but the vocabulary gives it {known}; "
            "the tokenizer files do not belong together"
        )
