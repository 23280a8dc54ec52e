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


def test_the_kernel_benchmark_times_h3s_real_lengths_and_says_plainly_it_needs_a_gpu():
    import sys

    import torch

    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import bench_gpu_kernels as bench
    finally:
        sys.path.pop(0)
    from h3core.model.config import preset

    lengths = {name: preset("h3").num_tokens(*size, bench.TEXT_ROWS) for name, size in bench.LENGTHS.items()}
    assert lengths == {"864x480x141": 17_608, "1344x768x243": 73_514}  # the seed's clip and the official 10 s one
    if not torch.cuda.is_available():
        done = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_gpu_kernels.py")], capture_output=True, text=True)
        assert done.returncode == 2 and done.stdout.strip().splitlines() == ["error: this benchmark needs a CUDA GPU (it times CUDA kernels)"]
