"""A run's adapters, decided before any rank starts: checked, hashed, and what each rank will hold.

`plan_adapters(specs, config, plan, dtype)` opens every adapter of a request against the run's model
(`open_adapter`: format, keys, shapes, finite values; one line for anything wrong), hashes the file
and records (`AdapterRecord`) its name, sha256, format, the user's scale, the linears it adapts and
the bytes of its branch on every rank of the plan: whole in Ulysses mode; in tensor mode cut like
the linear (`h3core.lora.tensor`): a column-parallel linear's B rows and a row-parallel one's A
columns shrink with the rank's share, the other matrix stays whole. The memory check counts them
(`adapter_bytes_per_rank`), the ranks read the file again by its path (the sha256 is the report's),
and the schedules the adapters ask for are merged (`h3core.lora.schedule`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

import torch
from pydantic import BaseModel, ConfigDict, Field

from h3core.lora.adapter import AdapterFile, Pair, open_adapter, sha256_of
from h3core.lora.schedule import AdapterSchedule, merge_schedules
from h3core.lora.spec import LoraSpec
from h3core.model.config import ModelConfig

SCALE_BYTES = 4
"""Each rank of a branch carries its float32 scale."""


class AdapterRecord(BaseModel):
    """One adapter of a run, as the report records it."""

    model_config = ConfigDict(frozen=True)
    name: str = Field(description="The file's name without its suffix.")
    path: str = Field(description="The file the ranks read.")
    sha256: str
    format: str = Field(description="peft, kohya or original-peft (h3core.lora.keys).")
    scale: float = Field(description="The user's scale (times each pair's alpha / rank).")
    layers: int = Field(description="Linears of the model it adapts.")
    pairs: int = Field(description="Its (A, B) pairs (a diffusers qkv adapter has three per linear).")
    ranks: list[int] = Field(description="The ranks of its pairs (e.g. [16, 64]).")
    alpha_scales: list[float] = Field(description="The distinct alpha / rank of its pairs.")
    bytes_per_rank: list[int] = Field(description="Bytes of its branches on each rank of the plan (in the dtype each linear computes in).")
    schedule: AdapterSchedule | None = Field(None, description="The sampling schedule its metadata asks for (None: none).")


_memo: dict[tuple, str] = {}


def file_sha256(path: Path) -> str:
    """sha256 of a file, remembered in this process while its size and times stay the same."""
    info = os.stat(path)
    key = (str(Path(path).resolve()), info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns)
    if key not in _memo:
        _memo[key] = sha256_of(Path(path))
    return _memo[key]


def open_adapters(specs: Sequence[LoraSpec], config: ModelConfig) -> list[tuple[LoraSpec, AdapterFile]]:
    """Every adapter of a request opened and checked against `config`, values included (one line for anything wrong)."""
    return [(spec, open_adapter(spec.path, config)) for spec in specs]


def adapters_schedule(opened: Sequence[tuple[LoraSpec, AdapterFile]]) -> AdapterSchedule | None:
    """The schedule a run's adapters ask for together (None: none asks; two that disagree: one line)."""
    asked = [adapter.schedule for _, adapter in opened if not adapter.schedule.empty]
    return merge_schedules(asked) if asked else None


def adapter_records(opened: Sequence[tuple[LoraSpec, AdapterFile]], config: ModelConfig, plan, dtype: torch.dtype) -> list[AdapterRecord]:  # type: ignore[no-untyped-def]
    """The report's record of each opened adapter, hashed and costed on `plan`'s ranks."""
    return [
        AdapterRecord(
            name=adapter.name, path=str(adapter.path), sha256=file_sha256(adapter.path), format=adapter.format.value, scale=spec.scale,
            layers=len(adapter.targets), pairs=len(adapter.pairs), ranks=adapter.ranks,
            alpha_scales=sorted({p.scale for p in adapter.pairs}), bytes_per_rank=branch_bytes(adapter, config, plan, dtype),
            schedule=None if adapter.schedule.empty else adapter.schedule,
        )
        for spec, adapter in opened
    ]


def plan_adapters(specs: Sequence[LoraSpec], config: ModelConfig, plan, dtype: torch.dtype) -> list[AdapterRecord]:  # type: ignore[no-untyped-def]
    """Every adapter of a request checked against `config` and costed on `plan`'s ranks (module docstring)."""
    return adapter_records(open_adapters(specs, config), config, plan, dtype)


def adapter_bytes_per_rank(records: Sequence[AdapterRecord], ranks: int) -> list[int]:
    """Bytes every rank holds for all of a run's adapters."""
    return [sum(r.bytes_per_rank[i] for r in records) for i in range(ranks)]


def branch_bytes(adapter: AdapterFile, config: ModelConfig, plan, dtype: torch.dtype) -> list[int]:  # type: ignore[no-untyped-def]
    """Bytes of `adapter`'s branches on each rank of `plan`: float32 for the model's float32 islands,
    `dtype` (the stream dtype) elsewhere; cut like tensor mode cuts the block linears."""
    from h3core.model.dit import H3Model

    skeleton = H3Model(config)
    return [sum(_pair_bytes(p, skeleton, rank.tensor, dtype) for p in adapter.pairs) for rank in plan.ranks]


def _pair_bytes(pair: Pair, skeleton, shares, dtype: torch.dtype) -> int:  # type: ignore[no-untyped-def]
    item = 4 if skeleton.fp32_module(pair.target) else dtype.itemsize
    rows, rank, width = len(pair.keys.rows), pair.rank, pair.in_features
    linear = pair.target.split(".", 2)[2] if pair.target.startswith("blocks.") else None
    cut = shares.cut_of(linear) if shares is not None and linear is not None else None  # (tensor mode's TensorShards)
    if cut is not None:
        if cut.split == "column":
            rows = sum(pair.keys.rows.overlap(span) for span in cut.part)
        else:
            width = len(cut.part.elements)
    return (rank * width + rows * rank) * item + rank * SCALE_BYTES
