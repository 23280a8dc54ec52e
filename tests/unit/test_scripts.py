"""The shipped scripts stay in step with the CLI they call."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted((ROOT / "scripts").glob("*.sh"))


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_shell_scripts_parse(script):
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0


def test_gpu_check_uses_only_flags_that_exist():
    text = (ROOT / "scripts" / "gpu_check.sh").read_text()
    for command, args in re.findall(r"\bh3 (generate|verify|bench-transport) ([^\n]*)", text):
        flags = set(re.findall(r"(--[a-z][a-z-]*)", args))
        help_text = subprocess.run([sys.executable, "-m", "h3cli.main", command, "--help"], capture_output=True, text=True, env={"COLUMNS": "300", "PATH": ""}).stdout
        missing = {f for f in flags if f not in help_text}
        assert not missing, f"h3 {command} has no {missing}"
