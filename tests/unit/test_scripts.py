"""The shipped scripts stay in step with the CLI they call."""

import re
import subprocess
from pathlib import Path

import pytest
from typer.testing import CliRunner

from h3cli.main import app

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted((ROOT / "scripts").glob("*.sh"))


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_shell_scripts_parse(script):
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0


def test_gpu_check_uses_only_flags_that_exist():
    text = (ROOT / "scripts" / "gpu_check.sh").read_text()
    for command, args in re.findall(r"\bh3 (generate|verify|bench-transport) ([^\n]*)", text):
        flags = set(re.findall(r"(--[a-z][a-z-]*)", args))
        help_text = CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "300"}).stdout
        missing = {f for f in flags if f not in help_text}
        assert not missing, f"h3 {command} has no {missing}"
