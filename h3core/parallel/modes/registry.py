"""A distributed mode is one object (`ParallelMode`) in one registry; nothing else branches on its name.

A mode owns everything that differs between ways of splitting the model over the ranks of a group:

| what | method |
|---|---|
| the per-rank shards the plan records (and `h3 plan` prints) | `shards`, `plan_tables` |
| the checkpoint bytes each rank holds | `weights_per_rank` |
| what the loader leaves out because the mode reads it as shards | `left_out_at_load` |
| how it is applied to a loaded model (wrappers, hooks, shards) | `apply` |
| the linears whose input its ranks split (one fp4 activation scale agreed over them) | `input_split_linears` |
| one block's activation working set on the largest rank | `activation_elements` |
| how far one linear computed its way is from one rank's, in eps (the parity bound) | `rounding_ulps` |

`Mode` is a registered mode's name (a `str`, validated against the registry; `Mode.ULYSSES`,
`Mode.TENSOR`; iterating `Mode` gives the registered modes). A mode registered from outside
(`register`) reaches `h3 plan`, the memory check and the parity bound without any other module
changing; a method it does not provide fails loudly (`ModeIncomplete`) naming the method.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Iterator, Sequence

from pydantic import GetCoreSchemaHandler
from pydantic_core import core_schema

from h3core.errors import ConfigError

if TYPE_CHECKING:
    import torch
    from torch import nn

_REGISTRY: dict[str, "ParallelMode"] = {}


class ModeIncomplete(ConfigError):
    """A registered mode lacks a piece a command needs."""


class _Registered(type):
    def __iter__(cls) -> Iterator["Mode"]:
        return iter([cls(name) for name in _REGISTRY])

    def __len__(cls) -> int:
        return len(_REGISTRY)


class Mode(str, metaclass=_Registered):
    """The name of a registered distributed mode ('ulysses', 'tensor', or one registered later)."""

    ULYSSES: ClassVar["Mode"]
    TENSOR: ClassVar["Mode"]

    def __new__(cls, name: object) -> "Mode":
        text = str(getattr(name, "value", name))
        if text not in _REGISTRY:
            raise ConfigError(f"unknown mode {text!r}; choose one of: {', '.join(_REGISTRY)}")
        return super().__new__(cls, text)

    @property
    def value(self) -> str:
        return str(self)

    @property
    def impl(self) -> "ParallelMode":
        return _REGISTRY[str(self)]

    def __repr__(self) -> str:
        return f"Mode({str(self)!r})"

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: GetCoreSchemaHandler) -> core_schema.CoreSchema:
        return core_schema.no_info_after_validator_function(
            cls, core_schema.str_schema(), serialization=core_schema.plain_serializer_function_ser_schema(str),
        )


class ParallelMode:
    """One way of splitting the model over a group's ranks (module docstring). Subclass and `register`."""

    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    """One line for `--help` and `h3 plan`."""

    def _missing(self, what: str, method: str) -> ModeIncomplete:
        return ModeIncomplete(f"mode {self.name!r} does not define {what} (ParallelMode.{method}); it cannot run or be planned yet")

    # --- planning (the partition of one group) -------------------------------------------------------

    def shards(self, config: Any, heads: Sequence[Any]) -> list[Any]:
        """Per rank, what it holds of the block linears (None: whole replicas)."""
        raise self._missing("what each rank holds of the block linears", "shards")

    def weights_per_rank(self, specs: Sequence[Any], ranks: Sequence[Any], config: Any) -> list[tuple[int, int]]:
        """Per rank of the plan: (stored bytes held, of which 16-bit dense) of the checkpoint `specs`."""
        raise self._missing("the checkpoint bytes each rank holds", "weights_per_rank")

    def plan_tables(self, plan: Any) -> list[tuple[str, list[str], list[list[str]]]]:
        """Extra tables `h3 plan` prints for this mode: (title, column names, rows)."""
        return []

    def activation_elements(self, config: Any, plan: Any, tokens: int) -> int:
        """Elements of the larger of one block's attention and MLP working sets on the largest rank
        (`tokens`: rows of the longest sequence)."""
        raise self._missing("its activation memory", "activation_elements")

    def rounding_ulps(self, dtype: "torch.dtype") -> float:
        """How far one linear computed this mode's way is from the one-rank way, relative to its
        largest output, in eps of `dtype` (measured: scripts/derive_parity_bounds.py)."""
        raise self._missing("its rounding for the parity bound", "rounding_ulps")

    # --- applying (on every rank) --------------------------------------------------------------------

    def left_out_at_load(self, num_blocks: int) -> tuple[str, ...]:
        """State-dict prefixes the loader leaves out because `apply` reads them as shards."""
        return ()

    def apply(self, model: "nn.Module", runtime: Any, weights: Any) -> None:
        """Reshape a loaded model for this mode from outside (the model file knows no parallelism)."""
        raise self._missing("how it is applied to the model", "apply")

    def input_split_linears(self, model: "nn.Module") -> list["nn.Module"]:
        """The linears whose input this mode's ranks split (their fp4 activation scale is agreed)."""
        raise self._missing("which linears' inputs its ranks split", "input_split_linears")


def register(mode: ParallelMode) -> ParallelMode:
    """Add a mode to the registry (its `name` must be new)."""
    if not mode.name or mode.name in _REGISTRY:
        raise ValueError(f"a mode needs a new name; {mode.name!r} is {'taken' if mode.name else 'empty'}")
    _REGISTRY[mode.name] = mode
    return mode


def unregister(name: str) -> None:
    """Remove a mode (tests that register one of their own)."""
    _REGISTRY.pop(name, None)


def mode_of(name: object) -> ParallelMode:
    """The mode object of a name (a `Mode`, its string, or an enum-like with `.value`)."""
    return Mode(name).impl
