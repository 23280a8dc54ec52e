"""Which NVFP4 linears a run holds decoded once (Hopper's option), what that costs, and the choice.

On the `cuda-dequant-bf16` path (GPUs before compute capability 10: Hopper) every NVFP4 linear
decodes its whole weight on every forward (`h3core.nvfp4.matmul.dequant_linear`): for H3 that is
all 200 block linears, 49 times 50 blocks per request. Where the device has room, each rank can
instead hold its NVFP4 linears decoded once in bf16 (`NVFP4Linear.hold_decoded`), built at load:
the same GEMMs on the same values, so bitwise the same outputs, for `out x in x 2` bytes more per
linear. In Ulysses mode those are every NVFP4 linear whole (replicated: 38.5 GB for H3's 200 block
linears); in tensor mode each rank's shards (about 1/N of that).

`DecodedWeights` is the plan's record of it: whether the linears are held decoded, which, the
bytes per rank, and why. `choose` decides: `on`/`off` force it; `auto` holds them where the run's
NVFP4 linears take the dequant path on a GPU and the decoded bytes fit beside the run's need
(`need_bytes`, the memory check's estimate of one rank's device need) with `HEADROOM` of the GPU
to spare; otherwise not.
"""

from __future__ import annotations

from typing import Literal, Sequence

from pydantic import BaseModel, Field

from h3core.model.config import ModelConfig

DecodedChoice = Literal["auto", "on", "off"]
CHOICES: tuple[str, ...] = ("auto", "on", "off")

HEADROOM = 0.10
"""Fraction of a GPU's usable memory `auto` keeps free beyond the estimated need (the need is a
lower bound; the dry run's prediction of a real run's peak has been up to ~1.2x of it)."""

BYTES_PER_ELEMENT = 2  # bf16


class DecodedWeights(BaseModel):
    """The NVFP4 linears a rank holds decoded in bf16, and the cost (`h3core.parallel.decoded`)."""

    held: bool = Field(description="The NVFP4 linears are held decoded once (else decoded on every forward).")
    linears: list[str] = Field(default_factory=list, description="Which: NVFP4 linear names, '*' for every block index.")
    count: int = Field(0, description="NVFP4 linears per rank that would be held decoded.")
    bytes_per_rank: list[int] = Field(default_factory=list, description="Bytes the decoded weights take on each rank (whether held or not: the cost).")
    reason: str = Field("", description="Why held or not.")


def decoded_weights(config: ModelConfig, plan, nvfp4_prefixes: Sequence[str], held: bool, reason: str) -> DecodedWeights:
    """The record for `plan`'s ranks (a `ParallelPlan`): each rank's NVFP4 linears (its shards in tensor mode) and their bf16 bytes."""
    shapes = _linear_shapes(config)
    per_rank = [sum(_held_elements(prefix, shapes[prefix], rank, config) for prefix in nvfp4_prefixes) * BYTES_PER_ELEMENT for rank in plan.ranks]
    names = sorted({_pattern(p) for p in nvfp4_prefixes})
    return DecodedWeights(held=held, linears=names, count=len(nvfp4_prefixes), bytes_per_rank=per_rank, reason=reason)


def choose(choice: str, *, dequant_on_gpu: bool, need_bytes: int, gpu_bytes: int | None, cost_bytes: int) -> tuple[bool, str]:
    """(held, why) for `choice` ('auto', 'on', 'off'): see the module docstring."""
    if choice == "on":
        return True, "asked for (--decoded-weights on)"
    if choice == "off":
        return False, "turned off (--decoded-weights off)"
    if not dequant_on_gpu:
        return False, "auto: the NVFP4 linears do not take cuda-dequant-bf16 here (nothing is decoded per forward to save)"
    if not cost_bytes:
        return False, "auto: the checkpoint has no NVFP4 linears"
    if gpu_bytes is None:
        return False, "auto: the GPU's memory is unknown"
    room = int(gpu_bytes * (1 - HEADROOM)) - need_bytes
    if cost_bytes <= room:
        return True, f"auto: {cost_bytes:,} bytes fit beside the run's need of {need_bytes:,} on a GPU of {gpu_bytes:,} usable"
    return False, f"auto: {cost_bytes:,} bytes do not fit beside the run's need of {need_bytes:,} on a GPU of {gpu_bytes:,} usable ({HEADROOM:.0%} kept free)"


def apply_decoded(model, decoded: DecodedWeights | None) -> int:  # type: ignore[no-untyped-def]
    """Hold every NVFP4 linear of a loaded, parallelized `model` decoded where `decoded` says so (after
    `parallelize`: tensor mode's shards are then in place); returns the bytes now held for them."""
    from h3core.nvfp4.linear import NVFP4Linear

    if decoded is None or not decoded.held:
        return 0
    return sum(m.hold_decoded() for m in model.modules() if isinstance(m, NVFP4Linear))


def _linear_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    from h3core.model.checkpoint import linear_slots
    from h3core.model.dit import H3Model

    return {prefix: (slot.out_features, slot.in_features) for prefix, slot in linear_slots(H3Model(config))}


def _held_elements(prefix: str, shape: tuple[int, int], rank, config: ModelConfig) -> int:  # type: ignore[no-untyped-def]
    """Weight elements of linear `prefix` on `rank`: whole, or in tensor mode its shard's rows or columns."""
    from h3core.parallel.modes.tensor_shards import TENSOR_PARALLEL, Split

    out_features, in_features = shape
    linear = prefix.split(".", 2)[2] if prefix.startswith("blocks.") else None
    if rank.tensor is None or linear not in TENSOR_PARALLEL:
        return out_features * in_features
    part = rank.tensor.of(linear)
    if TENSOR_PARALLEL[linear] is Split.COLUMN:
        return sum(len(s) for s in part) * in_features
    return out_features * len(part.elements)


def _pattern(prefix: str) -> str:
    parts = prefix.split(".")
    return ".".join("*" if p.isdigit() else p for p in parts)
