"""The matrix report as people read it: table rows (shared by the terminal and Markdown), the
Markdown file, and the PNG chart (speedup and peak memory per rank vs rank count, per mode)."""

from __future__ import annotations

import io

from h3core.bench.alternate import NOISE, Spread, beyond_ideal
from h3core.generate.profile import COLLECTIVES
from h3core.matrix.report import CHART_NAME, CellStatus, MatrixCell, MatrixReport, cell_name, mode_label
from h3core.parallel.modes import Mode
from h3core.reports.units import format_bytes

COLUMNS = (
    "mode", "ranks", "status", "sampling", "step", "speedup", "eff.", "peak mem/rank", "weights/rank",
    "coll. sent", "max abs", "rel (tol)", "parity",
)
"""Summary columns; the last three compare the cell's latents with one rank of the same mode."""


def _number(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g} s"


def _step(cell: MatrixCell) -> str:
    """The median step time, with its spread over the runs when there were several."""
    s = cell.step_spread
    if s is None or len(cell.step_seconds_runs) < 2:
        return _seconds(cell.step_seconds)
    return f"{s.median:.3g} s ({s.min:.3g}-{s.max:.3g})"


def _speedup(cell: MatrixCell) -> str:
    """The speedup, with its spread, and the flag where it is above the ideal by more than that spread."""
    s = cell.speedup_spread
    if s is None or cell.count == 1:
        return _number(cell.speedup, ".2f")
    text = f"{s.median:.2f} ({s.min:.2f}-{s.max:.2f})" if len(cell.step_seconds_runs) > 1 else f"{s.median:.2f}"
    return f"{text} {NOISE}" if cell.noise else text


def _status(cell: MatrixCell) -> str:
    if cell.status is CellStatus.OK and not cell.requested:
        return "baseline"
    return cell.status.value


def _parity_columns(cell: MatrixCell) -> tuple[str, str, str]:
    if cell.status is not CellStatus.OK:
        return "-", "-", "-"
    if cell.count == 1:
        return "-", "-", "reference"
    if cell.parity is None:
        return "-", "-", "not measured"
    p = cell.parity
    verdict = "bitwise" if p.bitwise else ("pass" if p.passed else "FAIL")
    return f"{p.max_abs:.3g}", f"{p.relative:.3g} ({p.tolerance:g})", verdict


def summary_rows(report: MatrixReport) -> list[list[str]]:
    """One row per cell, in `COLUMNS` order."""
    rows = []
    for c in report.cells:
        rows.append([
            mode_label(c.mode, c.cfg_parallel), str(c.count), _status(c), _seconds(c.sampling_seconds), _step(c), _speedup(c),
            _number(c.efficiency, ".0%") + (" !" if c.noise else ""), format_bytes(c.peak_memory_bytes), format_bytes(c.weight_bytes_per_rank),
            format_bytes(c.comm_bytes), *_parity_columns(c),
        ])
    return rows


SPLIT_COLUMNS = (
    "mode", "ranks", "step", "attention", "nvfp4 linears", "seq->head", "head->seq", "gather", "reduce-scatter",
    "other coll.", "rest", "compute speedup",
)
"""Where a cell's step goes (profiled cells): seconds per step (share) by category, mean over ranks.
`compute speedup` = the mode's 1-rank attention + linears time / this cell's: how the compute alone
scales; the gap to the cell's speedup is what collectives and the rest cost. It comes from one
(profiled) run, so it has no spread: above the ideal at all, it is flagged as noise."""

_SPLIT_KINDS = ("attention", "nvfp4_linears", "seq_to_head", "head_to_seq", "gather_rows", "reduce_scatter_rows")
"""Categories with a column of their own; the other collectives (repartition, cfg_exchange, broadcast) add up in `other coll.`."""


def _compute_seconds(split: dict[str, float]) -> float:
    return split.get("attention", 0.0) + split.get("nvfp4_linears", 0.0)


def split_rows(report: MatrixReport) -> list[list[str]]:
    """One row per profiled cell, in `SPLIT_COLUMNS` order (empty when no cell was profiled)."""
    baseline = {c.mode: _compute_seconds(c.split) for c in report.cells if c.count == 1 and c.split}
    rows = []
    for c in report.cells:
        if not c.split:
            continue
        step = c.split.get("step", 0.0)

        def cell(seconds: float) -> str:
            return f"{seconds:.3g} ({seconds / step:.0%})" if step > 0 else f"{seconds:.3g}"

        other = sum(c.split.get(k, 0.0) for k in COLLECTIVES if k not in _SPLIT_KINDS)
        compute = _compute_seconds(c.split)
        speedup = baseline[c.mode] / compute if baseline.get(c.mode) and compute > 0 else None
        flag = f" {NOISE}" if speedup is not None and beyond_ideal(Spread(min=speedup, median=speedup, max=speedup), c.count) else ""
        rows.append([
            mode_label(c.mode, c.cfg_parallel), str(c.count), _seconds(step), *(cell(c.split.get(k, 0.0)) for k in _SPLIT_KINDS),
            cell(other), cell(c.split.get("rest", 0.0)), _number(speedup, ".2f") + flag,
        ])
    return rows


def caption(report: MatrixReport) -> list[str]:
    """Lines above the table: what ran, on what, and how to read the figures."""
    s = report.shape
    run = f"{s.width}x{s.height}, {s.frames} frames, {s.steps} steps" if s else "no runnable cell"
    lines = [
        f"h3 matrix · preset {report.preset} · weights {report.weights} · {run} · {report.dtype} · "
        f"attention {report.request.template.attention} · seed {report.request.template.seed}",
        f"{report.device_name}: {report.ranks_note}",
        "sampling = all steps; step = median step after the first (warm-up); speedup = the mode's 1-rank step / the cell's; "
        "efficiency = speedup / ranks; "
        f"peak memory = {report.peak_memory_kind}, largest rank",
        f"each cell ran {report.request.repeat} time(s), in rounds interleaved across the cells: step = the median of its runs (min-max); "
        f"speedup (slowest-fastest baseline over fastest-slowest run); a speedup above the ideal by more than that spread is marked "
        f"'{NOISE}' (!): the baseline was slowed, the cell did not scale",
    ]
    if report.device == "cpu":
        threads = {c.count: c.threads_per_rank for c in report.cells if c.threads_per_rank}
        by_count = ", ".join(f"{n} rank{'s' if n > 1 else ''}: {t}" for n, t in sorted(threads.items()))
        lines.append(
            f"CPU: a cell's ranks share the cores (intra-op threads per rank: {by_count}), so these speedups measure core "
            "sharing, not GPU scaling; parity compares with one rank run at the cell's per-rank thread count."
        )
    return lines


def notes(report: MatrixReport) -> list[str]:
    """Lines below the table: why cells were skipped or failed, unmeasured parity, the identity check."""
    lines = []
    for c in report.cells:
        name = cell_name(c)
        if c.reason:
            lines.append(f"{name} {c.status.value}: {c.reason}")
        if c.parity_error:
            lines.append(f"{name} parity not measured: {c.parity_error}")
    if report.scaling_note:
        lines.append(report.scaling_note)
    if report.identity is not None:
        i = report.identity
        verdict = "bitwise identical" if i.bitwise else f"DIFFER (max abs {i.max_abs:.3g})"
        lines.append(f"1-rank identity path, {report.request.modes[1].value} vs {report.request.modes[0].value}: {verdict}")
    return lines


def markdown(report: MatrixReport) -> str:
    """matrix.md: caption, the summary table, notes and file names."""
    out = [f"# h3 matrix ({report.created}{'' if report.complete else ', incomplete'})", ""]
    out += [f"{line}  " for line in caption(report)]
    out += ["", "| " + " | ".join(COLUMNS) + " |", "|" + "|".join("---" for _ in COLUMNS) + "|"]
    out += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in summary_rows(report)]
    splits = split_rows(report)
    if splits:
        out += ["", "Where a step goes (profiled; seconds per step after the first, mean over ranks, share of the step):", ""]
        out += ["| " + " | ".join(SPLIT_COLUMNS) + " |", "|" + "|".join("---" for _ in SPLIT_COLUMNS) + "|"]
        out += ["| " + " | ".join(splits_row) + " |" for splits_row in splits]
    if notes(report):
        out += [""] + [f"- {line}" for line in notes(report)]
    if report.files and report.files.chart:
        out += ["", f"![speedup and peak memory per rank]({CHART_NAME})"]
    return "\n".join(out) + "\n"



def _series(report: MatrixReport, mode: Mode, value, cfg_parallel: bool = False) -> tuple[list[int], list[float]]:
    cells = [c for c in report.cells if c.mode == mode and c.cfg_parallel == cfg_parallel and c.status is CellStatus.OK and value(c) is not None]
    return [c.count for c in cells], [value(c) for c in cells]


def chart_png(report: MatrixReport) -> bytes:
    """Left: speedup vs ranks per mode, with the ideal (linear) line. Right: peak memory per rank."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.8))
    counts = sorted({c.count for c in report.cells if c.status is CellStatus.OK}) or [1]
    _speedup_panel(left, report, counts)
    _memory_panel(right, report, counts)
    fig.suptitle("\n".join(_chart_title(report)), fontsize=9)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    plt.close(fig)
    return buffer.getvalue()


_MARKERS = ("o", "s", "^", "D")


def _speedup_panel(ax, report: MatrixReport, counts: list[int]) -> None:
    ax.plot(counts, counts, linestyle="--", color="grey", label="ideal (linear)")
    for (mode, cfg), marker in zip(_lines(report), _MARKERS * 2):
        line, = ax.plot(*_series(report, mode, lambda c: c.speedup, cfg), marker=marker, linestyle=":" if cfg else "-", label=mode_label(mode, cfg))
        spread = [c for c in report.cells if c.mode == mode and c.cfg_parallel == cfg and c.speedup_spread is not None and c.status is CellStatus.OK]
        ax.vlines([c.count for c in spread], [c.speedup_spread.min for c in spread], [c.speedup_spread.max for c in spread], color=line.get_color())
    noisy = [c for c in report.cells if c.noise and c.speedup is not None]
    if noisy:
        ax.scatter([c.count for c in noisy], [c.speedup for c in noisy], s=160, facecolors="none", edgecolors="red", label=NOISE)
    ax.set(title="speedup vs the mode's 1-rank run", xlabel="ranks", ylabel="speedup (x)", xticks=counts)
    _finish(ax)


def _memory_panel(ax, report: MatrixReport, counts: list[int]) -> None:
    peak = max((c.peak_memory_bytes or 0 for c in report.cells), default=0)
    unit, scale = ("GiB", 2**30) if peak >= 2 * 2**30 else ("MiB", 2**20)
    for (mode, cfg), marker in zip(_lines(report), _MARKERS * 2):
        memory = lambda c: c.peak_memory_bytes / scale if c.peak_memory_bytes is not None else None  # noqa: E731
        ax.plot(*_series(report, mode, memory, cfg), marker=marker, linestyle=":" if cfg else "-", label=mode_label(mode, cfg))
    ax.set(title=f"peak memory per rank (largest rank)\n{report.peak_memory_kind}", xlabel="ranks", ylabel=unit, xticks=counts)
    _finish(ax)


def _lines(report: MatrixReport) -> list[tuple[Mode, bool]]:
    """One line per mode, and per mode again for its CFG-parallel cells."""
    return [(m, False) for m in report.request.modes] + ([(m, True) for m in report.request.modes] if report.request.cfg_parallel else [])


def _finish(ax) -> None:
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend()


def _chart_title(report: MatrixReport) -> list[str]:
    s = report.shape
    lines = [f"h3 matrix · {report.preset} · {s.width}x{s.height}, {s.frames} frames, {s.steps} steps · {report.device_name}" if s else "h3 matrix"]
    lines.append(report.ranks_note + (" (speedups measure core sharing, not GPU scaling)" if report.device == "cpu" else ""))
    failed = [cell_name(c) for c in report.cells if c.status is not CellStatus.OK]
    if failed:
        lines.append(f"not plotted (skipped or failed): {', '.join(failed)}")
    return lines
