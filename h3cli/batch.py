"""`h3 generate --prompts FILE`'s side of the terminal: the job, two progress bars (prompts of the
batch, steps of the current prompt), the summary table or --json's BatchReport, the exit code."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn
from rich.table import Table

from h3cli.output import Output, styled, text_column
from h3core.errors import ConfigError

_STATUS_STYLE = {"ok": "green", "skipped": "cyan", "failed": "red", "pending": "yellow"}


def run_batch_command(job: Any, prompts: Path, out: Output) -> None:
    """`job`: the `GenerateJob` of the flags; every prompt of `prompts` starts from its request."""
    from h3core.batch.plan import BatchJob
    from h3core.batch.run import run_batch

    if job.benchmark is not None:
        raise ConfigError("--benchmark / H3_DISTRIBUTED_BENCHMARK copy one run's report: a batch writes batch.json and a report.json per prompt in --output; unset it")
    batch = BatchJob(template=job.request, prompts_file=prompts, output=job.output, save_latents=job.save_latents, overwrite=job.overwrite,
                     decode=job.decode, video_vae=job.video_vae, audio_vae=job.audio_vae)
    with batch_bars(out.err if out.json_mode else out.console) as update:
        report = run_batch(batch, on_progress=update)
    out.result(report, lambda console: render_batch(report, console))
    out.exit_for(report)


def render_batch(report: Any, console: Console) -> None:
    """One row per prompt: status, seconds, load seconds paid, folder or error."""
    table = Table(
        title=f"h3 generate --prompts {report.prompts_file} · {report.mode.value} · {report.world_size} rank(s) on {report.device}",
        title_justify="left",
    )
    for name, justify in (("#", "right"), ("prompt", "left"), ("status", "left"), ("seconds", "right"), ("load s", "right"), ("folder / error", "left")):
        table.add_column(name, justify=justify, overflow="fold")
    for p in report.prompts:
        status = p.status.value
        where = p.error if p.error else p.folder
        table.add_row(
            str(p.index), p.prompt[:48], styled(status, _STATUS_STYLE[status]),
            f"{p.seconds:.2f}" if p.seconds is not None else "", f"{p.load_seconds:.2f}" if p.load_seconds is not None else "", where,
        )
    console.print(table)
    counts = ", ".join(f"{report.count(s)} {s.value}" for s in type(report.prompts[0].status) if report.count(s)) if report.prompts else "none"
    text = f"text encoder {report.text_encoder_seconds:.2f}s once · " if report.text_encoder_seconds is not None else ""
    console.print(f"{counts} · {text}denoiser loaded {report.loads}x · {report.directory}/batch.json")
    if report.other_folders:
        shown = ", ".join(report.other_folders[:5]) + (", ..." if len(report.other_folders) > 5 else "")
        console.print(f"left as they were: {len(report.other_folders)} folder(s) no prompt of this file claims ({shown})", soft_wrap=True)


@contextmanager
def batch_bars(console: Console) -> Iterator[Callable[[Any], None]]:
    """Two transient bars that appear with the first update (off when `console` is not a terminal)."""
    bars = Progress(text_column("{task.description}", "bold"), BarColumn(), MofNCompleteColumn(), text_column("{task.fields[note]}"),
                    TimeElapsedColumn(), console=console, transient=True, disable=not console.is_terminal)
    prompts = bars.add_task("prompts", total=None, note="")
    steps = bars.add_task("steps", total=None, note="")
    started = False

    def update(message: Any) -> None:
        nonlocal started
        if not started:
            bars.start()
            started = True
        bars.update(prompts, completed=message.done, total=message.total, note=message.prompt)
        note = f"{message.step_seconds:.2f}s/step" if message.step_seconds is not None else ""
        bars.update(steps, completed=message.step, total=message.steps or None, note=note)

    try:
        yield update
    finally:
        if started:
            bars.stop()
