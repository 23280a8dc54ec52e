"""`h3 --help` and every `h3 <command> --help` import no torch (issue 35.1): building the CLI's help
must not pay for the model's imports (2.2 s of torch on this machine before)."""

import os
import re
import subprocess
import sys

import pytest

HEAVY = ("torch", "diffusers", "transformers", "av", "PIL", "numpy", "safetensors")

PROGRAM = """
import sys

import pytest
import typer
from typer.testing import CliRunner
from h3cli.main import app

group = typer.main.get_command(app)
paths = [[]]
for name, command in group.commands.items():
    paths.append([name])
    paths += [[name, sub] for sub in getattr(command, "commands", {})]
runner = CliRunner()
for path in paths:
    result = runner.invoke(app, path + ["--help"])
    assert result.exit_code == 0, (path, result.output)
    assert "Usage" in result.output, path
print(len(paths))
heavy = [name for name in HEAVY_NAMES if name in sys.modules]
assert not heavy, heavy
"""


def test_the_help_of_every_command_imports_nothing_heavy():
    done = subprocess.run([sys.executable, "-c", PROGRAM.replace("HEAVY_NAMES", repr(HEAVY))], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert int(done.stdout.split()[-1]) >= 10  # every command and subcommand was built


def test_the_check_sees_a_heavy_import():
    """Mutation: the same program with torch imported first fails the check."""
    program = "import torch\n" + PROGRAM.replace("HEAVY_NAMES", repr(HEAVY))
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "torch" in done.stderr


@pytest.mark.parametrize("command", ["generate", "serve", "matrix"])
def test_the_run_commands_help_reads_at_80_columns_in_panels(command):
    """Issue 36.8: the options grouped in panels, no type column, no line over 80 columns."""
    from h3cli.options import PANELS

    done = subprocess.run([sys.executable, "-m", "h3cli.main", command, "--help"], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "COLUMNS": "80", "TERM": "dumb"})
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80
    options = [line for line in lines if line.startswith("│ --")]
    assert options and not [line for line in options if re.search(r"<(str|int|bool|float|path|text)>", line)]
    titles = {m.group(1) for line in lines if (m := re.match(r"╭─ (.+?) ─", line))}
    expected = {"generate": set(PANELS) - {"Server"}, "serve": set(PANELS) - {"Output"} | {"Server"}, "matrix": set(PANELS) - {"Server"}}[command]
    assert expected <= titles, titles


def test_docs_cli_names_every_command_script_and_variable():
    """The README is the newcomer's page; docs/cli.md is the reference, and it misses nothing."""
    import typer

    from h3cli.main import app
    from h3core.settings import environment

    root = __import__("pathlib").Path(__file__).resolve().parents[2]
    reference = (root / "docs" / "cli.md").read_text()
    for name in typer.main.get_command(app).commands:
        assert f"h3 {name}" in reference, name
    for script in (root / "scripts").iterdir():
        if script.suffix in (".py", ".sh"):
            assert script.name in reference, script.name
    for variable in sorted(set(re.findall(r'"(H3_[A-Z0-9_]+)"', (root / "h3core" / "settings" / "environment.py").read_text()))):
        assert variable in reference, variable
    assert len((root / "README.md").read_text()) < 8000  # a page read in minutes (was 34 KB)
