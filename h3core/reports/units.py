"""Sizes for people: the one byte formatter of every table, caption and error line."""

from __future__ import annotations

_BINARY = (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))


def format_bytes(n: float | None) -> str:
    """Bytes with three significant digits in binary units: 705 KiB, 1.41 MiB, 263 MiB, 24.1 GiB
    ('-' for None, '512 B' below a KiB)."""
    if n is None:
        return "-"
    for unit, scale in _BINARY:
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{int(n)} B"
