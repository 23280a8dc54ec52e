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

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Any, Protocol

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictBool, StrictStr, ValidationError
from pydantic_core import PydanticCustomError

from h3core.errors import CheckpointError
from h3core.files.text import MAX_CONFIG_BYTES, check_depth, read_json, read_text

SHIPPED_FOLDER = Path(__file__).parent / "h3_tokenizer"
"""H3's tokenizer as h3 ships it: Qwen's vocab.json and merges.txt, and H3's added tokens."""

SHIPPED_NAME = "h3 (shipped: Qwen3-VL vocabulary + H3 tokens)"

TOKENIZER_JSON, VOCAB, MERGES, CONFIG = "tokenizer.json", "vocab.json", "merges.txt", "tokenizer_config.json"

MAX_TOKENIZER_BYTES = 64 << 20
"""The largest tokenizer.json, vocab.json or merges.txt read (Qwen's are 11, 2.7 and 1.6 MB)."""

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
    """The tokenizer in `folder` with the added tokens its `tokenizer_config.json` declares.

    Every file is read as h3 reads text and JSON (`h3core.files.text`: UTF-8 with a byte-order mark
    dropped, bounded in size; JSON in depth too) and handed to `tokenizers` as data."""
    files = TokenizerFiles(folder)
    config = _read_config(folder / CONFIG)
    if files.has_tokenizer_json:
        text = read_text(folder / TOKENIZER_JSON, "the tokenizer", MAX_TOKENIZER_BYTES, _HINT, CheckpointError)
        check_depth(text, str(folder / TOKENIZER_JSON), _HINT, CheckpointError)
        tokenizer = _built(folder, lambda: _from_tokenizer_json(text))
    else:
        vocab, merges = _read_vocab(folder / VOCAB), _read_merges(folder / MERGES)
        tokenizer = _built(folder, lambda: _from_vocab_and_merges(vocab, merges))
    _add_configured_tokens(tokenizer, config, folder)
    return QwenTokenizer(tokenizer, name)


_HINT = "take the model's own tokenizer files"


def _built(folder: Path, build: Any) -> Any:
    try:
        return build()
    except Exception as exc:  # the Rust side raises bare Exceptions on malformed files
        raise CheckpointError(f"cannot read the tokenizer in {folder}: {' '.join(str(exc).split())}") from None


def _from_tokenizer_json(text: str) -> Any:
    from tokenizers import Tokenizer

    return Tokenizer.from_str(text)


def _read_vocab(path: Path) -> dict[str, int]:
    """vocab.json: a JSON object of token -> id (ids non-negative integers)."""
    vocab = read_json(path, "the tokenizer's vocabulary", MAX_TOKENIZER_BYTES, _HINT, error=CheckpointError, want=dict)
    bad = next((k for k, v in vocab.items() if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < 2**32), None)
    if bad is not None:
        raise CheckpointError(f"{path}: token {bad!r} has the id {vocab[bad]!r}, not an integer from 0 to 2^32 - 1; {_HINT}")
    return vocab


def _read_merges(path: Path) -> list[tuple[str, str]]:
    """merges.txt: after an optional `#version` line, one merge per line, two tokens split by a space
    (the rule `tokenizers` reads it by)."""
    merges = []
    for number, line in enumerate(read_text(path, "the tokenizer's merges", MAX_TOKENIZER_BYTES, _HINT, CheckpointError).splitlines(), 1):
        if line.startswith("#version"):
            continue
        pair = line.split(" ")
        if len(pair) != 2:
            raise CheckpointError(f"{path}, line {number}: {line[:40]!r} is not two tokens split by one space; {_HINT}")
        merges.append((pair[0], pair[1]))
    return merges


def _from_vocab_and_merges(vocab: dict[str, int], merges: list[tuple[str, str]]) -> Any:
    from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE

    bpe = BPE(
        vocab=vocab, merges=merges, unk_token=None, continuing_subword_prefix="",
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


class AddedTokenSpec(BaseModel):
    """One added token as `tokenizer_config.json` states it (transformers' `AddedToken` fields)."""

    model_config = ConfigDict(frozen=True, extra="ignore")
    content: StrictStr = Field(min_length=1, description="The token's text, matched whole.")
    special: StrictBool = Field(False, description="A special token (never split, skipped when decoding with skip_special_tokens).")
    single_word: StrictBool | None = None
    lstrip: StrictBool | None = None
    rstrip: StrictBool | None = None
    normalized: StrictBool | None = None

    def flags(self) -> dict[str, bool]:
        """The matching flags the config states (those it leaves out keep `tokenizers`' defaults)."""
        given = {"single_word": self.single_word, "lstrip": self.lstrip, "rstrip": self.rstrip, "normalized": self.normalized}
        return {k: v for k, v in given.items() if v is not None}


def _token_id(key: str) -> str:
    if not (key.isascii() and key.isdigit() and len(key) <= 10 and int(key) < 2**32):
        raise PydanticCustomError("token_id", "is not a token id (an integer from 0 to 2^32 - 1)")
    return key


TokenId = Annotated[str, AfterValidator(_token_id)]
"""An id as a JSON key: a non-negative integer in decimal below 2^32 (what `tokenizers` takes)."""


class TokenizerConfig(BaseModel):
    """What h3 reads of `tokenizer_config.json`: the added tokens (other fields are transformers' own)."""

    model_config = ConfigDict(frozen=True, extra="ignore")
    added_tokens_decoder: dict[TokenId, AddedTokenSpec] = Field(default_factory=dict, description="Tokens at their stated ids.")
    additional_special_tokens: list[StrictStr | AddedTokenSpec] = Field(default_factory=list, description="Special tokens appended after the known ids, in order.")


def _read_config(path: Path) -> TokenizerConfig:
    """`tokenizer_config.json` (absent: no added tokens), validated: a malformed one is one line naming
    the file and the first field that is wrong."""
    if not path.is_file():
        return TokenizerConfig()
    raw = read_json(path, "the tokenizer config", MAX_CONFIG_BYTES, _HINT, error=CheckpointError, want=dict)
    try:
        return TokenizerConfig.model_validate(raw)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(p) for p in first["loc"] if p not in ("[key]", "str", "AddedTokenSpec"))  # (pydantic's tags)
        raise CheckpointError(f"{path}: {where}: {first['msg'][0].lower() + first['msg'][1:]} (got {_shown(first.get('input'))}); {_HINT}") from None


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _add_configured_tokens(tokenizer: Any, config: TokenizerConfig, folder: Path) -> None:
    """`added_tokens_decoder` at their stated ids, then `additional_special_tokens` not yet known
    appended in order (transformers' rule), each matched whole."""
    from tokenizers import AddedToken

    for token_id, spec in sorted(config.added_tokens_decoder.items(), key=lambda item: int(item[0])):
        _add(tokenizer, AddedToken(spec.content, special=spec.special, **spec.flags()), int(token_id), folder)
    for token in config.additional_special_tokens:
        content = token if isinstance(token, str) else token.content
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
