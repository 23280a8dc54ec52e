"""`h3 --help` and every `h3 <command> --help` import no torch (issue 35.1): building the CLI's help
must not pay for the model's imports (2.2 s of torch on this machine before)."""

import subprocess
import sys

HEAVY = ("torch", "diffusers", "transformers", "av", "PIL", "numpy", "safetensors")

PROGRAM = """
import sys
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
