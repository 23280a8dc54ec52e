"""`h3 verify`: every distributed piece vs its single-rank reference, as one table of measured errors."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich import box
from rich.console import Console
from rich.table import Table

from h3cli import options
from h3cli.output import Output, line, styled
from h3core.verify import CHECK_NAMES, CheckRow, VerifyConfig, VerifyReport

_VERDICT_STYLE = {"pass": ("pass", "green"), "fail": ("FAIL", "bold red"), "skip": ("skip", "dim")}


def _number(value: float | None) -> str:
    return "-" if value is None else ("0" if value == 0 else f"{value:.2g}")


def _tolerance(row: CheckRow) -> str:
    if row.tolerance is None:
        return "-"
    return f"{row.tolerance:g}"


def _render(report: VerifyReport, console: Console) -> None:
    segments = ", ".join(f"{kind} {n}" for kind, n in report.segments.items())
    ranks = f"{report.world_size} rank{'s' if report.world_size > 1 else ''} ({report.dist_backend})"
    table = Table(
        title=(
            f"h3 verify · {report.device_name} · {ranks} · {report.dtype} · preset {report.preset} "
            f"({report.num_tokens} tokens: {segments}) · {report.steps} steps · weights {report.weights}"
        ),
        title_justify="left",
        box=box.SIMPLE_HEAD,
        padding=(0, 1, 0, 0),
        pad_edge=False,
        show_edge=False,
    )
    # Process-group backend and dtype are the same for every row (rows at 1 rank use no group): in the title.
    for column in ("check", "variant", "ranks", "max abs", "rel", "tol", "verdict", "s"):
        numeric = column in ("ranks", "max abs", "rel", "tol", "s")
        table.add_column(column, justify="right" if numeric else "left", no_wrap=True)
    notes: dict[str, int] = {}  # reason -> footnote number (many skips share one reason)
    for row in report.rows:
        note = f" [{notes.setdefault(row.reason, len(notes) + 1)}]" if row.reason else ""
        table.add_row(
            row.check, row.mode, str(row.count), _number(row.max_abs), _number(row.relative),
            _tolerance(row), line(styled(*_VERDICT_STYLE[row.verdict]), note), f"{row.seconds:.2f}" if row.ran else "-",
        )
    console.print(table)
    for reason, number in notes.items():
        console.print(f"[{number}] {reason}", soft_wrap=True)
    counts = {verdict: sum(r.verdict == verdict for r in report.rows) for verdict in ("pass", "fail", "skip")}
    summary = f"{counts['pass']} passed, {counts['fail']} failed, {counts['skip']} skipped"
    console.print(line(
        styled(summary, "red" if counts["fail"] else "green"),
        f" in {report.seconds:.1f}s (ranks started in {report.spawn_seconds:.1f}s). rel = max abs / max |reference|; "
        f"tol = the largest rel that passes in {report.dtype} for that check; tol 0 = bitwise equal.",
    ))
    if report.report_path:
        console.print(f"report: {report.report_path}", soft_wrap=True)


def verify(
    checks: Annotated[
        Optional[list[str]],
        typer.Argument(metavar="CHECK", help=f"Checks to run (default: all): {', '.join(CHECK_NAMES)}.", show_default=False),
    ] = None,
    counts: Annotated[str, typer.Option("--counts", help="Rank counts for the distributed checks, comma-separated.")] = "2,4,6,8",
    device: Annotated[str, typer.Option("--device", help="auto, cpu or cuda (CUDA: one GPU per rank, NCCL, bf16).")] = "auto",
    preset: Annotated[str, typer.Option("--preset", help="Model preset whose shapes and synthetic weights the checks use.")] = "narrow",
    steps: Annotated[int, typer.Option("--steps", min=1, help="Denoising steps of the end-to-end parity runs.")] = 2,
    output: Annotated[
        Optional[Path],
        typer.Option("--output", "-o", help="Report folder: new or empty (see --overwrite). Default: H3_DISTRIBUTED_OUTPUT, else outputs/<time>-verify-<4 hex>.", show_default=False),
    ] = None,
    overwrite: options.Overwrite = False,
    json: options.Json = False,
) -> None:
    """Compare every distributed piece (transport, attention, collectives, projection, tensor parallel,
    NVFP4 shards, end-to-end latents, attention backends) with its single-rank reference."""
    from h3core.verify.runner import verify as run_verify

    config = VerifyConfig.from_flags(checks=checks or [], counts=counts, device=device, preset=preset, steps=steps, output=output, overwrite=overwrite)
    out = Output(json)
    with out.err.status(styled("h3 verify: preparing")) as status:
        report = run_verify(config, on_event=lambda message: status.update(styled(f"h3 verify: {message}")))
    out.result(report, lambda console: _render(report, console))
    out.exit_for(report)


def register(app: typer.Typer) -> None:
    app.command("verify")(verify)
