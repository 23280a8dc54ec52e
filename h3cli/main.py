"""The `h3` entry point: registers the commands and maps errors to one line and an exit code.

Ctrl-C and SIGTERM: `main` handles SIGTERM (what `timeout`, docker, SLURM and systemd send) by
raising `Terminated`, a KeyboardInterrupt, where Ctrl-C raises KeyboardInterrupt itself, so that
both run the same cleanup everywhere. Every command runs inside `_interruptible`, which turns
either into `Interrupted` (exit 130; SIGTERM: 143) saying that nothing was written (the output mechanism, `h3core.reports.outputs`,
makes that true: staged results are removed). A command that did leave something behind raises
its own `Interrupted` saying what (a matrix publishes its finished cells; a RunPod write that was
in flight may have been applied). (Typer would otherwise exit 130 without a word.)
"""

from __future__ import annotations

import functools
import signal
import sys
import threading
from typing import Annotated, Any, Callable, Optional

import typer

from h3core import __version__, settings
from h3core.errors import H3Error, Interrupted, Terminated
from h3core.files.paths import os_error_reason
from h3cli.output import LiteralConsole, line, literal, styled

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
    from h3cli import bench_transport, compare, decode, generate, matrix, plan, pod, serve, verify

    generate.register(app)
    decode.register(app)
    compare.register(app)
    plan.register(app)
    bench_transport.register(app)
    matrix.register(app)
    pod.register(app)
    verify.register(app)
    serve.register(app)
    _wrap_commands(app)
    _shape_help(app)


def _interruptible(callback: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(callback)
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return callback(*args, **kwargs)
        except KeyboardInterrupt as stop:  # Ctrl-C, or SIGTERM (`Terminated`, raised by `_on_sigterm`)
            raise Interrupted.by(stop, "; nothing was written") from None

    return run


def _wrap_commands(typer_app: typer.Typer) -> None:
    """Every command (also those of sub-apps such as `h3 pod`) runs inside `_interruptible`."""
    for command in typer_app.registered_commands:
        if command.callback is not None:
            command.callback = _interruptible(command.callback)
    for group in typer_app.registered_groups:
        if group.typer_instance is not None:
            _wrap_commands(group.typer_instance)


def _shape_help(typer_app: typer.Typer) -> None:
    """Every command (also those of sub-apps) is built as a `_ShapedCommand`."""
    for command in typer_app.registered_commands:
        command.cls = _ShapedCommand
    for group in typer_app.registered_groups:
        if group.typer_instance is not None:
            _shape_help(group.typer_instance)


class _ShapedCommand(typer.core.TyperCommand):
    """Help that reads at 80 columns: no type column (`<str>`, `<int>`: the help says what a value
    is; an option's own metavar, e.g. ROLE=PATH, stays), and the run commands' options in panels
    (`h3cli.options.PANELS`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        from h3cli.options import PANELLED, panel_of

        super().__init__(*args, **kwargs)
        for param in self.params:
            if param.param_type_name == "option":
                param.metavar = "" if param.metavar is None else param.metavar
            if isinstance(param, typer.core.TyperOption) and self.name in PANELLED:
                param.rich_help_panel = panel_of(param.opts) or param.rich_help_panel

    def get_help_option(self, ctx: Any) -> Any:
        option = super().get_help_option(ctx)
        if option is not None:
            option.metavar = ""
        return option


_register()


def _on_sigterm(signum: int, frame: Any) -> None:
    raise Terminated()


def main(argv: list[str] | None = None) -> None:
    """Run the CLI; an `H3Error` becomes one red line on stderr and its exit code. SIGTERM is
    handled as Ctrl-C is (module docstring), with exit 143."""
    if threading.current_thread() is not threading.main_thread():  # (a handler can only be set there)
        return _main(argv)
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        _main(argv)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _main(argv: list[str] | None) -> None:
    debug = settings.debug()
    err_console = LiteralConsole(stderr=True)
    try:
        code = app(args=argv, prog_name="h3", standalone_mode=False)  # (Typer's own errors come here, not boxed)
    except _PARSE_ERRORS as err:  # Typer's parsing: an unknown option or command, a value of the wrong type or range, a missing argument
        if type(err).__name__ == "NoArgsIsHelpError":  # `h3` or `h3 pod` alone: the help is printed, as Typer does
            sys.exit(2)
        if debug:
            raise
        err_console.print(line(styled("error:", "bold red"), " ", _one_line(_usage_line(err))), soft_wrap=True)
        sys.exit(getattr(err, "exit_code", 2))
    except typer.Abort:  # end of input at a prompt
        if debug:
            raise
        err_console.print(line(styled("error:", "bold red"), " aborted (end of input)"), soft_wrap=True)
        sys.exit(1)
    except Interrupted as err:
        if debug:
            raise
        err_console.print(styled(_one_line(str(err)), "bold red"), soft_wrap=True)
        sys.exit(err.exit_code)
    except H3Error as err:
        if debug:
            raise
        err_console.print(line(styled("error:", "bold red"), " ", _one_line(str(err))), soft_wrap=True)
        sys.exit(err.exit_code)
    except OSError as err:  # the file system or the OS refused something no check foresaw: still one line
        if debug:
            raise
        where = f" ({err.filename})" if getattr(err, "filename", None) else ""
        err_console.print(line(styled("error:", "bold red"), " ", _one_line(os_error_reason(err) + where), "; rerun with H3_DEBUG=1 for details"), soft_wrap=True)
        sys.exit(1)
    except KeyboardInterrupt as stop:  # outside a command (while Typer parses, say)
        if debug:
            raise
        err = Interrupted.by(stop, "")
        err_console.print(styled(str(err), "bold red"))
        sys.exit(err.exit_code)
    if isinstance(code, int) and code:  # `typer.Exit(code)` (out of standalone mode Typer returns its code)
        sys.exit(code)


def _parse_errors() -> tuple[type[Exception], ...]:
    """What Typer raises for a command line it cannot parse: its own exceptions (Typer 0.2x carries its
    own copy of click) and click's (earlier Typers use click itself)."""
    kinds: list[type[Exception]] = [typer.TyperException] if hasattr(typer, "TyperException") else []
    try:
        import click

        kinds.append(click.ClickException)
    except ImportError:
        pass
    return tuple(kinds)


_PARSE_ERRORS = _parse_errors()


def _usage_line(err: Exception) -> str:
    """Typer's error as h3's one line (never its boxed panel): its message, and where the command's help is."""
    message = (err.format_message() if hasattr(err, "format_message") else str(err)).strip().rstrip(".")
    message = message.replace("Value error, ", "")  # (pydantic's prefix where a value's own check refused it)
    message = message[:1].lower() + message[1:]
    context = getattr(err, "ctx", None)
    return f"{message}; see '{context.command_path} -h'" if context is not None else message


def _one_line(message: str) -> str:
    """An error is one line, whatever a path or a server's text in it holds (line breaks shown as `\\n`)."""
    return literal(message, one_line=True)


if __name__ == "__main__":
    main()
