"""The matrix's cells before anything runs: per mode the 1-rank cell, then the other counts, then
(with `--cfg-parallel`) the mode's CFG-parallel cells at every requested count; each resolved
(`h3core.generate.resolve`) or skipped with the reason (a count that does not split into two
halves, a half the partition rejects)."""

from __future__ import annotations

from dataclasses import dataclass

from h3core.errors import LayoutError, PartitionError, ResourceLimit
from h3core.generate.request import ResolvedRun, resolve
from h3core.matrix.request import MatrixRequest
from h3core.parallel.modes import Mode


@dataclass(frozen=True)
class PlannedCell:
    """A cell before it runs: its resolved run, or why it is skipped."""

    mode: Mode
    count: int
    cfg_parallel: bool
    requested: bool
    run: ResolvedRun | None
    skip: str | None


def skip_reason(count: int, device: str, visible_gpus: int) -> str | None:
    """Why a count cannot run on this machine (None: it can). CPU: any count, as Gloo ranks."""
    if device == "cuda" and count > visible_gpus:
        return f"{count} GPUs needed, {visible_gpus} visible"
    return None


def plan_cells(request: MatrixRequest, visible_gpus: int) -> list[PlannedCell]:
    """Per mode: the 1-rank cell, then the other counts ascending. A 1-rank cell that cannot be
    resolved is a user error for the whole matrix (raised); other counts the partition rejects are skipped."""
    cells = []
    for mode in request.modes:
        cells += [_plan_cell(request, mode, count, False, visible_gpus) for count in sorted({1, *request.counts})]
        if request.cfg_parallel:
            cells += [_plan_cell(request, mode, count, True, visible_gpus) for count in request.counts]
    return cells


def _plan_cell(request: MatrixRequest, mode: Mode, count: int, cfg: bool, visible_gpus: int) -> PlannedCell:
    requested = count in request.counts
    reason = skip_reason(count, request.template.device, visible_gpus)
    if reason is not None:
        return PlannedCell(mode, count, cfg, requested, None, reason)
    try:
        run = resolve(request.template.model_copy(update={"mode": mode, "world_size": count, "cfg_parallel": cfg}))
    except (PartitionError, ResourceLimit, LayoutError) as err:
        if count == 1 and not cfg:
            raise
        return PlannedCell(mode, count, cfg, requested, None, str(err))
    return PlannedCell(mode, count, cfg, requested, run, None)
