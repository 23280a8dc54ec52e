"""One output object per command: rich tables for people, JSON for programs.

Only the process that runs the CLI prints; distributed workers report back to it. Under
torchrun every rank runs the CLI, and only rank 0 talks (the others' consoles are quiet).
"""

from __future__ import annotations

import json
import sys
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from pydantic import BaseModel
from rich.console import Console
from rich.markup import escape
from rich.progress import Progress, ProgressColumn

from h3core.reports.schema import Verdict
from h3core.settings import is_rank_zero


class Output:
    def __init__(self, json_mode: bool = False):
        self.json_mode = json_mode
        quiet = not is_rank_zero()
        self.quiet = quiet
        self.console = Console(highlight=False, quiet=quiet)
        self.err = Console(stderr=True, highlight=False, quiet=quiet)

    def result(self, value: BaseModel | dict | list | None, render: Callable[[Console], Any] | None = None) -> None:
        """Print `value` as JSON in --json mode, else call `render` with the console."""
        if self.quiet or value is None:
            return
        if self.json_mode:
            data = value.model_dump(mode="json") if isinstance(value, BaseModel) else value
            sys.stdout.write(json.dumps(data, indent=2) + "\n")
            sys.stdout.flush()
        elif render is not None:
            render(self.console)

    def exit_for(self, report: Verdict | None) -> None:
        """The one way from a report to an exit code: raise the report's failure (exit 1), if any."""
        failure = report.failure() if report is not None else None
        if failure is not None:
            raise failure

    def info(self, message: str) -> None:
        """A progress or status line: stderr in --json mode so that stdout stays parseable."""
        (self.err if self.json_mode else self.console).print(message)

    def warn(self, message: str) -> None:
        self.err.print(f"[yellow]warning:[/] {escape(message)}", soft_wrap=True)


@contextmanager
def progress_bar(console: Console, *columns: ProgressColumn | str) -> Iterator[Callable[..., None]]:
    """A transient rich bar that first appears on the first update, so that a run that fails before
    its first step prints nothing but its error line; off when `console` is not a terminal.

    Yields `update(**fields)`, which takes `rich.progress.Progress.update`'s keywords.
    """
    bar = Progress(*columns, console=console, transient=True, disable=not console.is_terminal)
    task = bar.add_task("", total=None)
    started = False

    def update(**fields: Any) -> None:
        nonlocal started
        if not started:
            bar.start()
            started = True
        bar.update(task, **fields)

    try:
        yield update
    finally:
        if started:
            bar.stop()
