"""The one way h3 reads text and JSON: UTF-8 with an optional byte-order mark, bounded in size, and
JSON bounded in depth and in the length of its numbers.

Every text file h3 reads (prompt files, public keys, tokenizer files, merges) goes through
`read_text`; every JSON document (safetensors headers, shard indexes, `config.json`,
`tokenizer_config.json`, `comfy_quant` markers and `_quantization_metadata`, JSONL prompt lines,
VAE configs, the reports and caches h3 reads back, RunPod's answers) through `read_json` /
`parse_json` (or, for a document another parser reads, `tokenizers`' tokenizer.json, through
`check_depth`). What a hostile or damaged document can do is then decided here, once:

- a byte-order mark (`EF BB BF`, what Windows editors write) is not text: it is dropped;
- bytes that are not UTF-8 are one line naming the byte;
- a document larger than its reader's bound is refused by its size before it is decoded;
- nesting deeper than `MAX_DEPTH` is refused before the parser recurses (`json` would raise
  `RecursionError`, which no `except ValueError` catches), found by one linear pass over the
  brackets outside strings;
- a number longer than `MAX_NUMBER_CHARS` characters is refused (converting a 5,000-digit integer
  is Python's own `ValueError`, and its cost grows with the square of the digits);
- every malformed form (a syntax error, a wrong top-level type) is the same one line.

Each failure is one line of the caller's error class (`ConfigError` by default, `CheckpointError`
for model files, `RemoteAPIError` for a server), naming the file and saying what to do.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from h3core.errors import ConfigError, H3Error
from h3core.files.paths import read_bounded

MAX_DEPTH = 100
"""Deepest nesting of arrays and objects h3 parses. The JSON h3 reads nests at most some 10 levels
(a tokenizer, a report); Python's parser recurses once per level and fails near 1,000."""

MAX_NUMBER_CHARS = 100
"""Longest number h3 parses, in characters. The largest number in any file h3 reads is a byte
offset (20 digits); Python refuses to convert integers of more than 4,300 digits at all."""

MAX_CONFIG_BYTES = 16 << 20
"""Bound for a small JSON file (config.json, tokenizer_config.json, an index, a VAE config)."""

BOM = "\ufeff"
"""The byte-order mark as a character (what `EF BB BF` decodes to)."""

_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_STEPS = str.maketrans({"[": "\x01", "{": "\x01", "]": "\xff", "}": "\xff"})
_CHUNK = 1 << 20


class _Refused(Exception):
    """Why a document is not JSON h3 reads (a phrase: 'not valid JSON (...)'), before it is named."""


def read_text(path: Path | str, what: str, limit: int, hint: str, error: type[ConfigError] = ConfigError) -> str:
    """The text of the regular file `path` (at most `limit` bytes: `read_bounded`), UTF-8 with an
    optional byte-order mark; anything else is one `error` line 'cannot read WHAT PATH: why; HINT'."""
    data = read_bounded(path, what, limit, hint, error)
    try:
        return _decode(data)
    except _Refused as why:
        raise error(f"cannot read {what} {path}: {why}; {hint}") from None


def parse_json(data: bytes | str, where: str, hint: str, *, error: type[H3Error] = ConfigError, limit: int | None = None,
               want: type | None = None) -> Any:
    """The JSON document `data` (module docstring: size `limit`, depth, numbers, a byte-order mark;
    `want`: the top-level type it must be, `dict` or `list`). Any problem is one `error` line
    'WHERE: why; HINT'."""
    try:
        return _parse(data, limit, want)
    except _Refused as why:
        raise error(f"{where}: {why}; {hint}") from None


def read_json(path: Path | str, what: str, limit: int, hint: str, *, error: type[ConfigError] = ConfigError,
              want: type | None = None) -> Any:
    """The JSON document in the regular file `path` (`read_bounded`, then `parse_json`); any problem
    is one `error` line 'cannot read WHAT PATH: why; HINT'."""
    data = read_bounded(path, what, limit, hint, error)
    try:
        return _parse(data, limit, want)
    except _Refused as why:
        raise error(f"cannot read {what} {path}: {why}; {hint}") from None


def check_depth(text: str, where: str, hint: str, error: type[H3Error] = ConfigError) -> str:
    """`text`, when its JSON nests at most `MAX_DEPTH` levels: for a document another parser reads
    (`tokenizers` reads tokenizer.json), bounded as h3's own reads are; else one `error` line."""
    if _nesting_exceeds(text, MAX_DEPTH):
        raise error(f"{where}: JSON nested deeper than {MAX_DEPTH} levels; {hint}")
    return text


def _nesting_exceeds(text: str, depth: int) -> bool:
    """Whether arrays and objects in the JSON `text` nest deeper than `depth` (brackets inside
    strings do not count). Linear in `len(text)`, with no recursion."""
    if text.count("[") + text.count("{") <= depth:
        return False
    unescaped = text.replace("\\\\", "").replace('\\"', "")  # escaped backslashes, then escaped quotes: none is a string's end
    brackets = _NOT_BRACKET.sub("", "".join(unescaped.split('"')[::2]))  # what lies outside strings
    if brackets.count("[") + brackets.count("{") <= depth:
        return False
    import numpy as np

    steps = np.frombuffer(brackets.translate(_STEPS).encode("latin-1"), dtype=np.int8)  # +1 opens, -1 closes
    level = 0
    for start in range(0, len(steps), _CHUNK):
        running = np.cumsum(steps[start:start + _CHUNK], dtype=np.int32) + level  # (a depth fits: documents are < 2 GiB)
        if int(running.max()) > depth:
            return True
        level = int(running[-1])
    return False


# --- the parts ----------------------------------------------------------------------------------------


def _decode(data: bytes) -> str:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise _Refused(f"not UTF-8 text (byte {err.start})") from None
    return text.removeprefix(BOM)


def _parse(data: bytes | str, limit: int | None, want: type | None) -> Any:
    size = len(data.encode("utf-8")) if isinstance(data, str) else len(data)
    if limit is not None and size > limit:
        raise _Refused(f"larger than {_size(limit)}")
    text = _decode(data) if isinstance(data, (bytes, bytearray, memoryview)) else data.removeprefix(BOM)
    if _nesting_exceeds(text, MAX_DEPTH):
        raise _Refused(f"JSON nested deeper than {MAX_DEPTH} levels")
    try:
        value = json.loads(text, parse_int=_integer, parse_float=_float)
    except json.JSONDecodeError as err:
        raise _Refused(f"not valid JSON ({err.msg} at line {err.lineno} column {err.colno})") from None
    except RecursionError:  # the depth check's backstop (a parser called from deep in a stack)
        raise _Refused("JSON nested too deeply") from None
    except ValueError as err:  # what else the parser refuses
        raise _Refused(f"not valid JSON ({err})") from None
    if want is not None and not isinstance(value, want):
        raise _Refused(f"a JSON {_kind(value)}, not {'an object' if want is dict else 'a ' + _kind(want())}")
    return value


def _integer(text: str) -> int:
    _check_number(text)
    return int(text)


def _float(text: str) -> float:
    _check_number(text)
    return float(text)


def _check_number(text: str) -> None:
    if len(text) > MAX_NUMBER_CHARS:
        raise _Refused(f"a number of {len(text)} characters (h3 reads numbers of at most {MAX_NUMBER_CHARS})")


def _kind(value: Any) -> str:
    names = {dict: "object", list: "array", str: "string", bool: "boolean", int: "number", float: "number", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB" if n >= 1 << 10 else f"{n} bytes"
