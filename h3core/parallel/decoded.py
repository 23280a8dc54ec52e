"""Which NVFP4 linears a run holds decoded once, what that costs, and the choice.

Where no fp4 GEMM runs, every NVFP4 linear decodes its whole weight on every forward
(`h3core.nvfp4.matmul.dequant_linear`): on GPUs before compute capability 10 (Hopper, the
`cuda-dequant-bf16` path) and on the CPU (`cpu-dequant`, 2.33x a dense `F.linear` at M=128). For
H3 that is all 200 block linears, 49 times 50 blocks per request. Where memory allows, each rank
can instead hold its NVFP4 linears decoded once (`NVFP4Linear.hold_decoded`), built at load, in
the GEMM's dtype (bf16 on a GPU, the stream dtype on the CPU): the same GEMMs on the same values,
so bitwise the same outputs, for `out x in x element` bytes more per linear. In Ulysses mode those
are every NVFP4 linear whole (replicated: 38.5 GB in bf16 for H3's 200 block linears); in tensor
mode each rank's shards (about 1/N of that).

`DecodedWeights` is the plan's record of it: whether the linears are held decoded, which, the
bytes per rank, and why. `choose` decides: `on`/`off` force it; `auto` holds them where the run's
NVFP4 linears decode per forward and the decoded bytes fit beside the run's need (`need_bytes`: on
a GPU the memory check's estimate of one rank's device need against the GPU's usable bytes; on
the CPU every rank of this machine together against the host's available memory) with `HEADROOM`
of it to spare; otherwise not.
"""

from __future__ import annotations

from typing import Literal, Sequence

from pydantic import BaseModel, Field

from h3core.model.config import ModelConfig

DecodedChoice = Literal["auto", "on", "off"]
CHOICES: tuple[str, ...] = ("auto", "on", "off")

HEADROOM = 0.10
"""Fraction of the memory (a GPU's usable bytes, the host's available) `auto` keeps free beyond the estimated need (the need is a
lower bound; the dry run's prediction of a real run's peak has been up to ~1.2x of it)."""

GPU_ELEMENT_BYTES = 2
"""A decoded element on a GPU: bf16, the `cuda-dequant-bf16` GEMM's dtype (on the CPU: the stream dtype's)."""


class DecodedWeights(BaseModel):
    """The NVFP4 linears a rank holds decoded in the GEMM's dtype, and the cost (`h3core.parallel.decoded`)."""

    held: bool = Field(description="The NVFP4 linears are held decoded once (else decoded on every forward).")
    linears: list[str] = Field(default_factory=list, description="Which: NVFP4 linear names, '*' for every block index.")
    count: int = Field(0, description="NVFP4 linears per rank that would be held decoded.")
    bytes_per_rank: list[int] = Field(default_factory=list, description="Bytes the decoded weights take on each rank (whether held or not: the cost).")
    reason: str = Field("", description="Why held or not.")


def decoded_weights(config: ModelConfig, plan, nvfp4_prefixes: Sequence[str], held: bool, reason: str,
                    element_bytes: int = GPU_ELEMENT_BYTES) -> DecodedWeights:
    """The record for `plan`'s ranks (a `ParallelPlan`): each rank's NVFP4 linears (its shards in tensor
    mode) and their bytes decoded at `element_bytes` a weight."""
    shapes = _linear_shapes(config)
    per_rank = [sum(_held_elements(prefix, shapes[prefix], rank, config) for prefix in nvfp4_prefixes) * element_bytes for rank in plan.ranks]
    names = sorted({_pattern(p) for p in nvfp4_prefixes})
    return DecodedWeights(held=held, linears=names, count=len(nvfp4_prefixes), bytes_per_rank=per_rank, reason=reason)


def choose(choice: str, *, decodes: str | None, need_bytes: int, room_bytes: int | None, cost_bytes: int, room: str = "a GPU") -> tuple[bool, str]:
    """(held, why) for `choice` ('auto', 'on', 'off'): see the module docstring. `decodes`: the path on
    which the run's NVFP4 linears decode every forward (None: they run an fp4 GEMM); `room_bytes`:
    the memory `room` offers ('a GPU': one GPU's usable bytes; 'the host': its available bytes),
    `need_bytes` and `cost_bytes` the run's need and the decoded weights' bytes in that memory."""
    if choice == "on":
        return True, "asked for (--decoded-weights on)"
    if choice == "off":
        return False, "turned off (--decoded-weights off)"
    if decodes is None:
        return False, "auto: the NVFP4 linears run an fp4 GEMM here (nothing is decoded per forward to save)"
    if not cost_bytes:
        return False, "auto: the checkpoint has no NVFP4 linears"
    if room_bytes is None:
        return False, f"auto: the memory of {room} is unknown"
    left = int(room_bytes * (1 - HEADROOM)) - need_bytes
    if cost_bytes <= left:
        return True, f"auto ({decodes} decodes every forward): {cost_bytes:,} bytes fit beside the run's need of {need_bytes:,} on {room} of {room_bytes:,} usable"
    return False, (f"auto ({decodes} decodes every forward): {cost_bytes:,} bytes do not fit beside the run's need of {need_bytes:,} "
                   f"on {room} of {room_bytes:,} usable ({HEADROOM:.0%} kept free)")


def apply_decoded(model, decoded: DecodedWeights | None) -> int:  # type: ignore[no-untyped-def]
    """Hold every NVFP4 linear of a loaded, parallelized `model` decoded where `decoded` says so (after
    `parallelize`: tensor mode's shards are then in place) in the GEMM's dtype (bf16 on a GPU, the model's
    stream dtype on the CPU); returns the bytes now held for them."""
    from h3core.nvfp4.linear import NVFP4Linear

    if decoded is None or not decoded.held:
        return 0
    return sum(m.hold_decoded(m.gemm_dtype or model.dtype) for m in model.modules() if isinstance(m, NVFP4Linear))


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
