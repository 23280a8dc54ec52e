"""The `h3` entry point: registers the commands and maps errors to one line and an exit code.

Ctrl-C: every command runs inside `_interruptible`, which turns KeyboardInterrupt into
`Interrupted` (exit 130) saying that nothing was written (the output mechanism, `h3core.reports.outputs`,
makes that true: staged results are removed). A command that did leave something behind raises
its own `Interrupted` saying what (a matrix publishes its finished cells; a RunPod write that was
in flight may have been applied). (Typer would otherwise exit 130 without a word.)
"""

from __future__ import annotations

import functools
import sys
from typing import Annotated, Any, Callable, Optional

import typer
from rich.console import Console
from rich.markup import escape

from h3core import __version__, settings
from h3core.errors import H3Error, Interrupted
from h3core.files.paths import os_error_reason

app = typer.Typer(
    name="h3",
    help="Run H3 (NVFP4 text-to-video+audio DiT) on one GPU or all of them, and benchmark, verify and provision it.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        print(f"h3 {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        Optional[bool], typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = None,
) -> None:
    """Run H3 on one GPU or all of them, and benchmark, verify and provision it."""


def _register() -> None:
    from h3cli import bench_transport, decode, generate, matrix, plan, pod, verify

    generate.register(app)
    decode.register(app)
    plan.register(app)
    bench_transport.register(app)
    matrix.register(app)
    pod.register(app)
    verify.register(app)
    _wrap_commands(app)


def _interruptible(callback: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(callback)
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return callback(*args, **kwargs)
        except KeyboardInterrupt:
            raise Interrupted("interrupted (Ctrl-C); nothing was written") from None

    return run


def _wrap_commands(typer_app: typer.Typer) -> None:
    """Every command (also those of sub-apps such as `h3 pod`) runs inside `_interruptible`."""
    for command in typer_app.registered_commands:
        if command.callback is not None:
            command.callback = _interruptible(command.callback)
    for group in typer_app.registered_groups:
        if group.typer_instance is not None:
            _wrap_commands(group.typer_instance)


_register()


def main(argv: list[str] | None = None) -> None:
    """Run the CLI; an `H3Error` becomes one red line on stderr and its exit code."""
    debug = settings.debug()
    err_console = Console(stderr=True, highlight=False)
    try:
        app(args=argv, prog_name="h3")
    except Interrupted as err:
        if debug:
            raise
        err_console.print(f"[bold red]{escape(str(err))}[/]", soft_wrap=True)
        sys.exit(err.exit_code)
    except H3Error as err:
        if debug:
            raise
        err_console.print(f"[bold red]error:[/] {escape(str(err))}", soft_wrap=True)
        sys.exit(err.exit_code)
    except OSError as err:  # the file system or the OS refused something no check foresaw: still one line
        if debug:
            raise
        where = f" ({err.filename})" if getattr(err, "filename", None) else ""
        err_console.print(f"[bold red]error:[/] {escape(os_error_reason(err) + where)}; rerun with H3_DEBUG=1 for details", soft_wrap=True)
        sys.exit(1)
    except KeyboardInterrupt:
        if debug:
            raise
        err_console.print("[bold red]interrupted (Ctrl-C)[/]")
        sys.exit(130)


if __name__ == "__main__":
    main()
