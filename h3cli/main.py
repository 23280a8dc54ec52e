"""The `h3` entry point: registers the commands and maps errors to one line and an exit code."""

from __future__ import annotations

import os
import sys
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.markup import escape

from h3core import __version__
from h3core.errors import H3Error

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
    from h3cli import bench_transport, generate, matrix, plan, pod, verify

    generate.register(app)
    plan.register(app)
    bench_transport.register(app)
    matrix.register(app)
    pod.register(app)
    verify.register(app)


_register()


def main(argv: list[str] | None = None) -> None:
    """Run the CLI; an `H3Error` becomes one red line on stderr and its exit code."""
    debug = os.environ.get("H3_DEBUG", "") not in ("", "0")
    try:
        app(args=argv, prog_name="h3")
    except H3Error as err:
        if debug:
            raise
        Console(stderr=True, highlight=False).print(f"[bold red]error:[/] {escape(str(err))}", soft_wrap=True)
        sys.exit(err.exit_code)
    except KeyboardInterrupt:
        if debug:
            raise
        Console(stderr=True).print("[red]interrupted[/]")
        sys.exit(130)


if __name__ == "__main__":
    main()
