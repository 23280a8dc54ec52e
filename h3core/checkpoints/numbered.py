"""Numbers in tensor names (`blocks.N.`, `model.layers.N.`, `encoder.down.N.`), read without trusting them.

A count of blocks or layers comes from the names a file holds, so a hostile or damaged name must
not cost more than the name itself: `blocks.300000000.norm1.weight` would make a `range` up to it
(gigabytes), `blocks.<5000 digits>.` is Python's own `ValueError`, `blocks.².` another, and
`blocks.١.` (an Arabic-Indic digit) would be read as 1. Here an index is ASCII decimal without a
leading zero and of at most `MAX_INDEX_DIGITS` digits, and a gap is found by looking only at
`0 .. len(indices)`: the work is linear in the number of names whatever the numbers say.
"""

from __future__ import annotations

import re
from typing import Iterable

MAX_INDEX_DIGITS = 6
"""An index has at most this many digits (999,999): H3 has 50 blocks, Qwen3-VL-32B 64 layers."""

_INDEX = re.compile(rf"0|[1-9][0-9]{{0,{MAX_INDEX_DIGITS - 1}}}", re.ASCII)


class BadIndex(ValueError):
    """A name under a numbered prefix whose number is not an index (the caller names the file)."""

    def __init__(self, name: str, under: str):
        part = name[len(under):].split(".")[0]
        shown = part if len(part) <= 12 else f"{part[:12]}... ({len(part)} characters)"
        super().__init__(f"tensor {name[:80]!r} is not numbered as {under}<i>.… ({shown!r} is not an index from 0 to {10**MAX_INDEX_DIGITS - 1:,})")


def index_of(name: str, under: str) -> int:
    """`i` of a name `<under><i>.…` (`BadIndex` when the part after `under` is anything else)."""
    part = name[len(under):].split(".", 1)
    if len(part) != 2 or not _INDEX.fullmatch(part[0]):
        raise BadIndex(name, under)
    return int(part[0])


def indices_under(names: Iterable[str], under: str) -> set[int]:
    """The indices `i` of every name `<under><i>.…` (`BadIndex` for the first that has none)."""
    return {index_of(name, under) for name in names if name.startswith(under)}


def missing(indices: set[int], shown: int = 5) -> list[int]:
    """Up to `shown` indices of `0 .. max` that are absent, found among `0 .. len(indices)` only
    (an index past the count means a gap below it)."""
    return [i for i in range(len(indices) + shown) if i not in indices and i < max(indices, default=-1)][:shown]


def contiguous_count(indices: set[int]) -> int | None:
    """`n` when `indices` are exactly `0 .. n-1`, else None (then `missing` says which are not there)."""
    return len(indices) if not missing(indices, 1) else None
