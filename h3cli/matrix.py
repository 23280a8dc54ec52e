"""`h3 matrix`: `h3 generate` over modes x rank counts, one summary (seed: run_distributed_matrix.sh)."""

from __future__ import annotations

from typing import Annotated, Optional

import typer
from rich import box
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from h3cli import options
from h3cli.output import Output, progress_bar, text_column


def _render(report, console: Console) -> None:
    from h3core.matrix.render import COLUMNS, caption, notes, summary_rows

    lines = caption(report)
    rows = summary_rows(report)
    # One table on a wide terminal; on narrower ones the columns go into two or three tables
    # (timing | memory | parity), each led by mode and ranks, rather than truncated columns.
    timing, memory, parity = list(range(2, 7)), list(range(7, 10)), list(range(10, len(COLUMNS)))
    if console.width >= 150:
        parts = [timing + memory + parity]
    elif console.width >= 110:
        parts = [timing, memory + parity]
    else:
        parts = [timing, memory, parity]
    groups = [[0, 1, *part] for part in parts]
    for number, group in enumerate(groups):
        table = Table(title=lines[0] if number == 0 else None, title_justify="left", box=box.SIMPLE_HEAD, padding=(0, 1))
        for i in group:
            table.add_column(COLUMNS[i], justify="left" if COLUMNS[i] in ("mode", "status", "parity") else "right", overflow="fold")
        for row in rows:
            style = "red" if row[2] == "failed" or row[-1] == "FAIL" else ("dim" if row[2] == "skipped" else None)
            table.add_row(*(row[i] for i in group), style=style)
        console.print(table)
    _render_split(report, console)
    for line in lines[1:]:
        console.print(line, soft_wrap=True)
    for line in notes(report):
        console.print(f"  {line}", soft_wrap=True)
    if report.files:
        f = report.files
        console.print(f"files: {f.report}  {f.markdown}  {f.chart or ''}  (one folder per cell beside them)", soft_wrap=True)


def _render_split(report, console: Console) -> None:
    """Where each profiled cell's step goes (h3core.matrix.render.split_rows)."""
    from h3core.matrix.render import SPLIT_COLUMNS, split_rows

    rows = split_rows(report)
    if not rows:
        return
    table = Table(title="where a step goes: seconds per step (share), mean over ranks", title_justify="left", box=box.SIMPLE_HEAD, padding=(0, 1))
    for name in SPLIT_COLUMNS:
        table.add_column(name, justify="left" if name == "mode" else "right", overflow="fold")
    for row in rows:
        table.add_row(*row)
    console.print(table)


def matrix(
    counts: Annotated[Optional[str], typer.Option("--counts", help="Rank counts, e.g. 1,2,4. Default: H3_GPU_COUNTS, else 1,2,4,6,8. The 1-rank baseline of each mode always runs.", show_default=False)] = None,
    modes: Annotated[Optional[str], typer.Option("--modes", help="Modes, e.g. ulysses,tensor. Default: H3_DISTRIBUTED_MODES, else both.", show_default=False)] = None,
    prompt: options.Prompt = None,
    negative_prompt: options.NegativePrompt = "",
    guidance: options.Guidance = 1.0,
    cfg_parallel: Annotated[bool, typer.Option("--cfg-parallel", help="Also run every mode with CFG parallel (two halves, one per guidance branch) at each requested count; odd counts are skipped with the reason. Needs --guidance.")] = False,
    preset: options.RunPreset = None,
    width: options.Width = None,
    height: options.Height = None,
    frames: options.Frames = None,
    steps: options.Steps = None,
    seed: options.Seed = options.DEFAULT_SEED,
    attention: options.Attention = None,
    device: options.Device = "auto",
    dtype: options.Dtype = None,
    model: options.Model = None,
    text_encoder: options.TextEncoder = None,
    output: options.MatrixOutput = None,
    save_latents: options.SaveLatents = None,
    benchmark: options.Benchmark = None,
    overwrite: options.Overwrite = False,
    profile: options.Profile = True,
    repeat: Annotated[int, typer.Option("--repeat", help="Times each cell runs, in rounds interleaved across the cells; the step time is the median (min-max), and a speedup above the ideal by more than its spread is flagged as noise.")] = 3,
    compile_blocks: options.Compile = False,
    json: options.Json = False,
) -> None:
    """Run generate for every mode x rank count this machine can take; speedup, memory and parity per cell."""
    from h3core.generate.request import DEFAULT_PROMPT, GenerateRequest
    from h3core.matrix.request import MatrixRequest
    from h3core.matrix.run import run_matrix

    template = GenerateRequest(
        prompt=DEFAULT_PROMPT if prompt is None else prompt, negative_prompt=negative_prompt, guidance_scale=guidance,
        preset=preset, width=width, height=height, frames=frames, steps=steps, seed=seed, attention=attention or "sdpa",
        device=device, dtype=dtype, model_path=model, text_encoder_path=text_encoder, profile=profile and not compile_blocks,  # the profiler times eager modules only
        compile=compile_blocks,
    )
    request = MatrixRequest.build(template, counts=counts, modes=modes, save_latents=save_latents, output=output, benchmark=benchmark, overwrite=overwrite, cfg_parallel=cfg_parallel, repeat=repeat)
    out = Output(json)
    columns = (text_column("matrix", "bold"), text_column("{task.description}"), BarColumn(), MofNCompleteColumn(), text_column("steps"), TimeElapsedColumn(), TimeRemainingColumn())
    with progress_bar(out.err if json else out.console, *columns) as update:
        report = run_matrix(request, lambda m: update(completed=m.completed, total=m.total, description=m.label))
    out.result(report, lambda console: _render(report, console))
    out.exit_for(report)


def register(app: typer.Typer) -> None:
    app.command("matrix")(matrix)
