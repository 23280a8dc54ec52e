"""What a distributed mode is: its name (`Mode`, an `Enum`) and the planning protocol every mode's
planning object implements (`ParallelMode`), torch-free. The objects themselves are in
`h3core.parallel.modes.MODES` (see that package's docstring)."""

from __future__ import annotations

from enum import Enum
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, Sequence, runtime_checkable

from pydantic import GetCoreSchemaHandler
from pydantic_core import core_schema

from h3core.errors import ConfigError

if TYPE_CHECKING:
    from h3core.model.checkpoint import TensorSpec
    from h3core.model.config import ModelConfig
    from h3core.parallel.modes.tensor_shards import TensorShards
    from h3core.span import Span

PlanTable = tuple[str, list[str], list[list[str]]]
"""An extra table `h3 plan` prints: (title, column names, rows)."""


class BlockShape(NamedTuple):
    """What one block's working set depends on, on the largest rank of a plan (`ParallelPlan.block_shape`)."""

    tokens: int
    """Rows of the longest sequence of the run."""
    local_tokens: int
    """The most rows one rank holds of any sequence."""
    local_heads: int
    """The most heads one rank attends."""
    world_size: int
    overlapped: bool = False
    """Ulysses overlap (`h3core.parallel.overlap`): the returns' receive buffer is alive beside the send blocks."""


class Mode(str, Enum):
    """The name of a distributed mode. A `str` (JSON and reports write the plain name); `Mode("ring")`
    is one `ConfigError` line naming the modes there are."""

    ULYSSES = "ulysses"
    TENSOR = "tensor"

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    @classmethod
    def _missing_(cls, value: object) -> "Mode":
        text = str(getattr(value, "value", value))
        for mode in cls:
            if mode.value == text:
                return mode
        raise ConfigError(f"unknown mode {text!r}; choose one of: {', '.join(m.value for m in cls)}")

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: GetCoreSchemaHandler) -> core_schema.CoreSchema:
        """Validated from its name (an unknown one is `Mode`'s own one line); serialized as the plain name."""
        return core_schema.no_info_after_validator_function(
            cls, core_schema.str_schema(), serialization=core_schema.plain_serializer_function_ser_schema(str),
        )


@runtime_checkable
class ParallelMode(Protocol):
    """The planning side of one distributed mode (module docstring): plain, torch-free answers about
    a `ParallelPlan` that the launcher asks before any rank starts."""

    summary: str
    """One line for `--help` and `h3 plan`."""

    def shards(self, config: "ModelConfig", heads: Sequence["Span"]) -> list["TensorShards | None"]:
        """Per rank, what it holds of the block linears (None: whole replicas)."""
        ...

    def weights_per_rank(self, specs: Sequence["TensorSpec"], shards: Sequence["TensorShards | None"], config: "ModelConfig") -> list[tuple[int, int]]:
        """Per rank (its `shards`): (stored bytes held, of which 16-bit dense) of the checkpoint `specs`."""
        ...

    def plan_tables(self, shards: Sequence["TensorShards | None"]) -> list[PlanTable]:
        """Extra tables `h3 plan` prints for this mode (`shards`: each rank's, in rank order)."""
        ...

    def activation_elements(self, config: "ModelConfig", shape: BlockShape) -> int:
        """Elements of the larger of one block's attention and MLP working sets on the largest rank."""
        ...

    def rounding_ulps(self, itemsize: int) -> float:
        """How far one linear computed this mode's way is from the one-rank way, relative to its
        largest output, in eps of a float dtype of `itemsize` bytes (measured: scripts/derive_parity_bounds.py)."""
        ...

    def left_out_at_load(self, num_blocks: int) -> tuple[str, ...]:
        """State-dict prefixes the loader leaves out because the mode reads them as shards."""
        ...
