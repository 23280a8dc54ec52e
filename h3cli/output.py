"""How h3 talks to the terminal: one output object per command (rich tables for people, JSON for
programs), and the one console every line goes through, which prints text literally.

Text that reaches the terminal comes from users (paths, prompts, names) and from servers (pod
names, error details): `[/b]` or `[red]` is not markup, `:fire:` is not an emoji, an escape
sequence does not reach the terminal. `LiteralConsole` makes that true for everything printed
through it — strings, table cells and titles, progress and status text — with no escaping at the
call sites: markup, emoji codes and highlighting are off, and every control character (C0, DEL,
C1, the bidirectional overrides) is shown as its escape (`\\x1b`). h3's own styling is given as
`styled(text, style)` pieces, never as markup in a string.

Only the process that runs the CLI prints; distributed workers report back to it. Under
torchrun every rank runs the CLI, and only rank 0 talks (the others' consoles are quiet).
"""

from __future__ import annotations

import json
import re
import sys
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator

from pydantic import BaseModel
from rich.console import Console, ConsoleOptions, RenderableType
from rich.progress import Progress, ProgressColumn, Task, TextColumn
from rich.segment import Segment
from rich.style import Style
from rich.text import Text

from h3core.reports.schema import Verdict
from h3core.settings import is_rank_zero

_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]")
_CONTROL_OR_NEWLINE = re.compile(_CONTROL.pattern[:-1] + "\n\t]")


def literal(text: str, *, one_line: bool = False) -> str:
    """`text` with every control character as its escape (`\\x1b`, `\\u202e`); `one_line`: line breaks and tabs too."""
    pattern = _CONTROL_OR_NEWLINE if one_line else _CONTROL
    return pattern.sub(_escape, str(text))


_NAMED = {"\n": "\\n", "\t": "\\t", "\r": "\\r"}


def _escape(match: re.Match[str]) -> str:
    char = match.group()
    code = ord(char)
    return _NAMED.get(char) or (f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}")


def styled(text: str, style: str | Style = "") -> Text:
    """A piece of h3's own styling: `text`, printed literally, in `style`."""
    return Text(literal(text), style=style)


def line(*parts: str | Text) -> Text:
    """One line from literal strings and `styled` pieces."""
    return Text.assemble(*(part if isinstance(part, Text) else literal(part) for part in parts))


class LiteralConsole(Console):
    """A rich `Console` that prints every string literally (module docstring)."""

    def __init__(self, **kwargs: Any):
        super().__init__(markup=False, emoji=False, highlight=False, **kwargs)

    def render_str(self, text: str, **kwargs: Any) -> Text:
        """Every string a renderable holds (a table cell, a title) becomes literal text."""
        return super().render_str(literal(text), **{**kwargs, "markup": False, "emoji": False, "highlight": False})

    def render(self, renderable: RenderableType, options: ConsoleOptions | None = None) -> Iterable[Segment]:
        """The last line of defence: no control character leaves except rich's own control segments."""
        for segment in super().render(renderable, options):
            if segment.control is None and _CONTROL.search(segment.text):
                yield Segment(literal(segment.text), segment.style)
            else:
                yield segment


class Output:
    def __init__(self, json_mode: bool = False):
        self.json_mode = json_mode
        quiet = not is_rank_zero()
        self.quiet = quiet
        self.console = LiteralConsole(quiet=quiet)
        self.err = LiteralConsole(stderr=True, quiet=quiet)

    def result(self, value: BaseModel | dict | list | None, render: Callable[[Console], Any] | None = None) -> None:
        """Print `value` as JSON in --json mode (control characters as JSON escapes), else call `render` with the console."""
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

    def info(self, message: str | Text) -> None:
        """A progress or status line: stderr in --json mode so that stdout stays parseable."""
        (self.err if self.json_mode else self.console).print(message)

    def warn(self, message: str) -> None:
        self.err.print(line(styled("warning:", "yellow"), " ", message), soft_wrap=True)


class _LiteralTextColumn(TextColumn):
    def render(self, task: Task) -> Text:
        return Text(literal(self.text_format.format(task=task)), style=self.style, justify=self.justify)


def text_column(template: str, style: str = "") -> TextColumn:
    """A progress column whose `{task...}` fields are printed literally (rich's default parses them as markup)."""
    return _LiteralTextColumn(template, style=style, markup=False)


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
