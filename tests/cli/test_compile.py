"""`--compile` as a user runs it: the flag on every run command, the compile time printed and
recorded apart from the step times, and a machine that cannot compile told so in one line."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from h3cli.main import app
from h3core.generate.report import RunReport


@pytest.mark.parametrize("command", ["generate", "serve", "matrix"])
def test_every_run_command_takes_compile(command):
    help_text = CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "300"}).stdout
    assert "--compile" in help_text


@pytest.fixture(scope="module")
def compiled(tmp_path_factory, cache):
    """One compiled run at one rank: the tiny preset, one forward (the shape tests/unit compiles too,
    so inductor's on-disk cache serves whichever runs second)."""
    import torch

    torch._dynamo.reset()  # a test earlier in this process may have compiled this shape: the run must compile it itself
    out = tmp_path_factory.mktemp("compiled") / "run"
    done = CliRunner().invoke(app, ["generate", "--steps", "2", "--no-decode", "--compile", "--output", str(out)], env={"H3_CACHE_DIR": cache, "COLUMNS": "300"})
    assert done.exit_code == 0, done.output
    return done.output, RunReport.model_validate_json((out / "report.json").read_text())


def test_compile_time_is_printed_and_recorded_apart_from_the_steps(compiled):
    output, report = compiled
    record = report.compile
    assert record is not None and record.fullgraph and record.seconds > 0
    assert len(record.step_compile_seconds) == len(report.step_seconds) == 1
    assert record.step_seconds[0] == pytest.approx(max(0.0, report.step_seconds[0] - record.seconds), abs=1e-6)
    line = next(row for row in output.splitlines() if "compiling" in row)
    assert "compile" in line and f"{record.seconds:.2f}s compiling" in line and "one graph per block" in line
    assert report.attention_kernel.startswith("sdpa (torch.compile)")


def test_no_compiler_is_one_line_exit_2(h3, monkeypatch):
    monkeypatch.setenv("CXX", "/nonexistent/g++")
    code, out, err = h3("generate", "--compile", "--no-decode")
    assert code == 2 and "--compile" in err and "C++ compiler" in err and len(err.strip().splitlines()) == 1, err


def test_profile_cannot_see_inside_a_compiled_block_one_line_exit_2(h3):
    code, out, err = h3("generate", "--compile", "--profile", "--no-decode")
    assert code == 2 and "--profile" in err and "--compile" in err and len(err.strip().splitlines()) == 1, err
