"""Text that reaches the terminal is printed literally, whoever wrote it (a user's path or prompt, a
server's pod name or error detail): rich markup is not markup, emoji codes are not emoji, escape
sequences are shown as escapes, and an error is still one line (`h3cli.output.LiteralConsole`)."""

from __future__ import annotations

import io
import json

import pytest
from rich.progress import Progress
from rich.table import Table
from runpod_fake import problem

import h3core.pod.client as client_module
from commands import one_line, run_main
from h3cli.output import LiteralConsole, line, literal, progress_bar, styled, text_column
from h3core.pod import RetryPolicy

HOSTILE = ["q[/b]", "out[red]z", "[bold]x[/bold]", "a:fire:b", "\x1b]0;pwned\x07", "\x1b[31mred", "\u202eevil", "\x9b31m"]


def _printed(render, *, terminal: bool = False) -> str:
    buffer = io.StringIO()
    console = LiteralConsole(file=buffer, width=200, force_terminal=terminal, color_system="standard" if terminal else None)
    render(console)
    return buffer.getvalue()


def _shown(text: str) -> str:
    """What `text` looks like on the terminal: itself, control characters as escapes."""
    return literal(text)


@pytest.mark.parametrize("text", HOSTILE)
def test_every_way_of_printing_shows_the_text_itself(text):
    def render(console):
        console.print(text)
        console.print(f"path: {text}", soft_wrap=True)
        table = Table(title=text)
        table.add_column(text)
        table.add_row(text)
        console.print(table)
        console.print(line(styled("error:", "bold red"), " ", text))
        console.print(text, markup=True, emoji=True)  # a call site cannot switch it back on

    out = _printed(render)
    assert out.count(_shown(text)) == 7, out  # print, path, title, header, cell, error line, markup=True
    assert "\x1b" not in out and "\x9b" not in out and "\u202e" not in out and "🔥" not in out


@pytest.mark.parametrize("text", HOSTILE)
def test_on_a_colour_terminal_only_h3s_own_styles_are_escape_sequences(text):
    out = _printed(lambda console: console.print(line(styled("warning:", "yellow"), " ", text)), terminal=True)
    assert _shown(text) in out
    assert "\x1b]" not in out and "\x07" not in out and "\x1b[31mred" not in out and "\x9b" not in out


def test_progress_and_status_text_is_literal():
    buffer = io.StringIO()
    console = LiteralConsole(file=buffer, width=200, force_terminal=True, color_system=None)
    with progress_bar(console, text_column("{task.description}"), text_column("fixed [/b] :fire:")) as update:
        update(description="prompt [/b] :fire: \x1b]0;x\x07", completed=1, total=2)
    bars = Progress(text_column("{task.fields[note]}"), console=console)
    bars.add_task("", note="[red]z")
    console.print(bars.make_tasks_table(bars.tasks))
    out = buffer.getvalue()
    assert "prompt [/b] :fire: \\x1b]0;x\\x07" in out and "fixed [/b] :fire:" in out and "[red]z" in out
    assert "\x07" not in out


# --- the commands -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["q[/b]", "out[red]z", "x:fire:y"])
def test_generate_prints_the_path_it_wrote(h3, tmp_path, name):
    target = tmp_path / name
    code, out, err = h3("generate", "--steps", "2", "-o", str(target))
    assert code == 0, err
    assert (target / "report.json").is_file()
    assert str(target / "report.json") in out  # the path printed is the path that exists
    assert "🔥" not in out


def test_an_error_naming_a_hostile_path_is_one_literal_line(h3, tmp_path):
    missing = tmp_path / "no[/b]\nfile:fire:\x1b]0;x\x07.txt"
    code, _, err = h3("generate", "--prompts", str(missing))
    assert code == 2
    text = one_line(err)
    assert "no[/b]\\nfile:fire:\\x1b]0;x\\x07.txt" in text and "\x1b]" not in err


@pytest.fixture
def pod_h3(runpod_env, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    monkeypatch.delenv("H3_DEBUG", raising=False)
    monkeypatch.setattr(client_module, "DEFAULT_RETRY", RetryPolicy(attempts=1, backoff_s=0))
    return lambda *args: run_main(capsys, *args)


@pytest.mark.parametrize("name", ["job[/]1", "[red]z", "a:fire:b", "evil\x1b]0;pwned\x07", "x\x1b[2J"])
def test_a_pod_named_by_anyone_lists_and_shows_literally(pod_h3, runpod, name):
    pod = runpod.add_pod(name=name, image=f"img{name}")
    for args in (("pod", "list"), ("pod", "get", pod["id"]), ("pod", "terminate", pod["id"])):
        code, out, err = pod_h3(*args)
        assert code in (0, 2), err  # terminate without --yes: exit 2 after showing the pod
        assert "Traceback" not in err and _shown(name) in out, (args, out, err)
        assert "\x1b" not in out and "🔥" not in out
    code, out, _ = pod_h3("pod", "list", "--json")
    assert code == 0 and json.loads(out)["pods"][0]["name"] == name  # JSON keeps the text as it is, escaped


def test_an_api_error_with_markup_and_escapes_is_one_literal_line(pod_h3, runpod):
    runpod.script("GET", "/v2/pods", 403, problem(403, "Forbidden [/b]", "no :fire: \x1b]0;pwned\x07 here\nnext line"))
    code, _, err = pod_h3("pod", "list")
    assert code == 1
    text = one_line(err)
    assert "Forbidden [/b]" in text and ":fire:" in text and "\\x1b]0;pwned\\x07" in text and "\x1b]" not in err
