"""Code that must stay outside a compiled region -- the parallel modes' collectives -- marked without
importing the compiler.

`torch.compiler.disable` imports Dynamo when it decorates (about 1 s on this machine's CPU), so the
modes marking their collectives with it at import time made every run pay for a compiler that only
`--compile` (off by default) uses. `outside_compiled(fn)` marks `fn` and returns a plain function that
calls it; `disable_marked()`, which `h3core.model.compiled.CompiledBlocks` calls before it compiles,
replaces every marked function by `torch.compiler.disable(fn)`, once. Dynamo, tracing a block,
inlines the plain function and meets the disabled one: the graph breaks there, as it did when the
decorator was applied at import. An uncompiled run calls `fn` through one extra Python call.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


class _Marked:
    __slots__ = ("fn", "disabled")

    def __init__(self, fn: Callable[..., Any]):
        self.fn, self.disabled = fn, False


_MARKED: list[_Marked] = []


def outside_compiled(fn: F) -> F:
    """Mark `fn` (a function or method) as a region no compiled graph may contain (module docstring)."""
    marked = _Marked(fn)
    _MARKED.append(marked)

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        return marked.fn(*args, **kwargs)

    return call  # type: ignore[return-value]


def disable_marked() -> None:
    """Wrap every marked function in `torch.compiler.disable` (idempotent; imports Dynamo)."""
    import torch

    for marked in _MARKED:
        if not marked.disabled:
            marked.fn, marked.disabled = torch.compiler.disable(marked.fn), True
