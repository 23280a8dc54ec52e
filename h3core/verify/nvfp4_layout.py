"""`nvfp4`: tensor-mode shards keep the packed NVFP4 layout, bit for bit.

For every block linear of the spec's checkpoint and this rank's ranges (its `TensorShards` of the
run's plan, as tensor mode takes them), both shard sources tensor mode uses are checked against
plain slices of the full tensors:

- in memory: `h3core.nvfp4.shard.column_parallel` / `row_parallel` of the loaded linear;
- from disk: the checkpoint's `WeightSource` (`linear(rows=...)` / `(columns=...)`), which reads only the slice.

A shard passes when its packed `weight` and fp8 `weight_scale` bytes equal the slice of the full
tensors, its global scale is the full one, its bias is right (the rows' bias, or none on a
row-parallel shard), and `dequantize(shard)` equals the slice of `dequantize(full)` exactly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from h3core.model.checkpoint import Checkpoint
from h3core.model.dit import H3Model
from h3core.nvfp4.codec import dequantize
from h3core.nvfp4.io import WeightSource
from h3core.nvfp4.layout import ColumnSlice
from h3core.nvfp4.linear import NVFP4Linear
from h3core.nvfp4.shard import column_parallel, row_parallel
from h3core.parallel.modes import Mode
from h3core.runtime.context import RankContext
from h3core.runtime.device import Stopwatch
from h3core.span import Span
from h3core.verify.compare import measure
from h3core.verify.rows import Measure
from h3core.verify.spec import VerifySpec

NVFP4_VARIANTS = ("column-parallel", "row-parallel")


def measure_nvfp4(ctx: RankContext, spec: VerifySpec) -> list[Measure]:
    """This rank's column- and row-parallel shards of every block linear, from memory and from disk."""
    shards = spec.plan(ctx.world_size, Mode.TENSOR).ranks[ctx.rank].tensor
    assert shards is not None
    ckpt = Checkpoint.open(spec.checkpoint, spec.config)
    try:
        model, disk = ckpt.load(device=ctx.device), ckpt.weight_source(ctx.device, torch.float32)
        column = _timed(ctx, NVFP4_VARIANTS[0], _column_parallel_cases, disk, model, spec.config.num_blocks,
                        {"attn.qkv_proj": shards.qkv_rows, "mlp.fc1": shards.fc1_rows})
        row = _timed(ctx, NVFP4_VARIANTS[1], _row_parallel_cases, disk, model, spec.config.num_blocks,
                     {"attn.out_proj": shards.attn_out_columns, "mlp.fc2": shards.fc2_columns})
    finally:
        ckpt.file.reader.close()
    return [column, row]


def _timed(ctx: RankContext, variant: str, cases_of, disk: WeightSource, model: H3Model, blocks: int, ranges: dict) -> Measure:  # type: ignore[no-untyped-def]
    """One variant's cases for every block linear in `ranges`, compared and timed."""
    with Stopwatch(ctx.device) as watch:
        cases = [case for i in range(blocks) for name, part in ranges.items() for case in cases_of(disk, model, f"blocks.{i}.{name}", part)]
        measure = _all_cases(variant, cases)
    return measure.model_copy(update={"seconds": watch.seconds})


@dataclass
class _Expected:
    """What a shard must hold: slices of the full linear's tensors, cut once per linear."""

    packed: torch.Tensor  # [out_loc, in_loc/2] uint8
    scale: torch.Tensor  # [out_loc, in_loc/16] fp8
    global_scale: torch.Tensor  # [] the full tensor's
    bias: torch.Tensor | None  # its rows of the full bias (column-parallel), or none (row-parallel)
    dense: torch.Tensor  # [out_loc, in_loc] the slice of dequantize(full)

    @classmethod
    def rows_of(cls, full: NVFP4Linear, rows: Sequence[Span]) -> "_Expected":
        def cut(t: torch.Tensor) -> torch.Tensor:
            return torch.cat([t[s.start : s.stop] for s in rows])

        bias = None if full.bias is None else cut(full.bias)
        return cls(cut(full.weight), cut(full.block_scales), full.weight_scale_2, bias, cut(dequantize(full.nvfp4)))

    @classmethod
    def columns_of(cls, full: NVFP4Linear, columns: ColumnSlice) -> "_Expected":
        def cut(t: torch.Tensor, span: Span) -> torch.Tensor:
            return t[:, span.start : span.stop]

        return cls(
            cut(full.weight, columns.packed_bytes), cut(full.block_scales, columns.scale_columns), full.weight_scale_2,
            None, cut(dequantize(full.nvfp4), columns.elements),
        )


@dataclass
class _Case:
    """One shard to check against the slices of the full linear it was cut from."""

    name: str
    shard: NVFP4Linear
    expected: _Expected
    problems: list[str] = field(default_factory=list)


def _column_parallel_cases(disk: WeightSource, model: H3Model, prefix: str, rows: list[Span]) -> list[_Case]:
    full: NVFP4Linear = model.get_submodule(prefix)
    expected = _Expected.rows_of(full, rows)
    return [
        _Case(f"{prefix} (memory)", column_parallel(full, rows), expected),
        _Case(f"{prefix} (disk)", disk.linear(prefix, rows=rows), expected),
    ]


def _row_parallel_cases(disk: WeightSource, model: H3Model, prefix: str, columns: ColumnSlice) -> list[_Case]:
    full: NVFP4Linear = model.get_submodule(prefix)
    expected = _Expected.columns_of(full, columns)
    shard, bias_once = row_parallel(full, columns)
    memory = _Case(f"{prefix} (memory)", shard, expected)
    if not _same(bias_once, full.bias):
        memory.problems.append(f"{prefix}: the bias to add after the reduction is not the full bias")
    return [memory, _Case(f"{prefix} (disk)", disk.linear(prefix, columns=columns), expected)]


def _all_cases(variant: str, cases: list[_Case]) -> Measure:
    total = None
    for case in cases:
        one = _compare(variant, case)
        total = one if total is None else total.merged(one)
    assert total is not None
    return total


def _compare(variant: str, case: _Case) -> Measure:
    """Bytes, global scale and bias must be identical (differences are listed); dequantized values give the number."""
    shard, expected, name = case.shard, case.expected, case.name
    problems = list(case.problems)
    differing = _differing_bytes(shard.weight, expected.packed)
    if differing:
        problems.append(f"{name}: {differing} packed weight bytes differ from the slice")
    differing = _differing_bytes(shard.block_scales, expected.scale)
    if differing:
        problems.append(f"{name}: {differing} block-scale bytes differ from the slice")
    if not torch.equal(shard.weight_scale_2, expected.global_scale):
        problems.append(f"{name}: global scale {shard.weight_scale_2.item()} != {expected.global_scale.item()}")
    if not _same(shard.bias, expected.bias):
        problems.append(f"{name}: bias is not {'its rows of the full bias' if expected.bias is not None else 'absent'}")
    result = measure(variant, dequantize(shard.nvfp4), expected.dense, 0.0, worst=name)
    return result.model_copy(update={"mismatches": problems})


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and a.shape == b.shape and torch.equal(a, b))


def _differing_bytes(a: torch.Tensor, b: torch.Tensor) -> int:
    """Bytes that differ between two tensors of one shape (all of them when the shapes differ)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return max(a.numel() * a.element_size(), b.numel() * b.element_size())
    return int((a.contiguous().view(torch.uint8) != b.contiguous().view(torch.uint8)).sum().item())
