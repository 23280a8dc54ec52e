"""`h3 matrix` and the seed's scripts end to end, tiny preset, 2 steps: the command in this process, the
scripts as real processes (what they forward to is a real `h3`)."""

import json
import os
import pathlib
import subprocess
import sys
import uuid

import pytest
import torch

from h3core.generate.parity import tolerance
from h3core.matrix.report import CellStatus, MatrixReport
from h3core.parallel.modes import Mode

from commands import REPO, no_survivors, one_line

SMALL = ["--preset", "tiny", "--steps", "3", "--device", "cpu", "--repeat", "1"]  # (--repeat: tests/cli/test_matrix_repeat.py)
CLEAN = ("H3_GPU_COUNTS", "H3_DISTRIBUTED_MODES", "H3_SAVE_LATENTS", "H3_WORLD_SIZE", "H3_DISTRIBUTED_OUTPUT", "H3_DISTRIBUTED_BENCHMARK", "H3_INJECT_FAULT")


@pytest.fixture
def matrix(h3, monkeypatch):
    """`h3 matrix ...` in this process with `env` set and the seed's variables otherwise unset."""
    for name in CLEAN:
        monkeypatch.delenv(name, raising=False)

    def run(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
        for name, value in (env or {}).items():
            monkeypatch.setenv(name, value)
        return h3("matrix", *args)

    return run


def _env(extra):
    env = {k: v for k, v in os.environ.items() if k not in CLEAN}
    env["PATH"] = f"{pathlib.Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # `h3` for the scripts
    env["COLUMNS"] = "200"
    return {**env, **extra}


def _script(name, *args, env=None, timeout=300):
    return subprocess.run(["bash", str(REPO / "scripts" / name), *args], capture_output=True, text=True, env=_env(env or {}), timeout=timeout, cwd=REPO)


def test_both_modes_at_1_and_2_ranks_reports_only(matrix, tmp_path):
    out, bench = tmp_path / "m", tmp_path / "bench.json"
    code, stdout, err = matrix("--counts", "1,2", *SMALL, "--output", str(out), "--json", env={"H3_SAVE_LATENTS": "0", "H3_DISTRIBUTED_BENCHMARK": str(bench)})
    assert code == 0, err
    report = MatrixReport.model_validate_json(stdout)
    assert report.complete and report.request.save_latents is False and report.device == "cpu"
    assert [(c.mode, c.count, c.status) for c in report.cells] == [
        (m, n, CellStatus.OK) for m in (Mode.ULYSSES, Mode.TENSOR) for n in (1, 2)
    ]
    for cell in report.cells:
        assert cell.sampling_seconds > 0 and cell.peak_memory_bytes > 0 and cell.weight_bytes_per_rank > 0
        assert cell.speedup > 0 and cell.efficiency == pytest.approx(cell.speedup / cell.count)
    one, two = report.cell(Mode.TENSOR, 1), report.cell(Mode.TENSOR, 2)
    assert one.speedup == 1.0 and one.comm_bytes == 0 and one.parity is None
    assert two.weight_bytes_per_rank < one.weight_bytes_per_rank  # tensor mode holds a share of the linears
    assert two.comm_bytes > 0 and two.parity.passed and two.parity.tolerance == tolerance(Mode.TENSOR, torch.float32) and "1 CPU thread" in two.parity.reference
    assert report.cell(Mode.ULYSSES, 2).parity.bitwise  # Ulysses only moves data
    assert report.identity is not None and report.identity.bitwise
    # files: matrix JSON (also at H3_DISTRIBUTED_BENCHMARK), Markdown, PNG, a folder per cell, no latents
    assert MatrixReport.model_validate_json((out / "matrix.json").read_text()) == report
    assert MatrixReport.model_validate_json(bench.read_text()) == report
    markdown = (out / "matrix.md").read_text()
    assert markdown.count("\n| ulysses |") == 4 and "Where a step goes" in markdown  # summary rows + split rows
    # profiled by default: each cell's step split into categories that add up to it
    for cell in report.cells:
        assert abs(sum(v for k, v in cell.split.items() if k != "step") - cell.split["step"]) < 1e-9
    assert report.cell(Mode.ULYSSES, 2).split["seq_to_head"] > 0 and report.cell(Mode.TENSOR, 2).split["gather_rows"] > 0
    assert (out / "matrix.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["tensor-1", "tensor-2", "ulysses-1", "ulysses-2"]
    assert json.loads((out / "tensor-2" / "report.json").read_text())["parity"]["passed"] is True
    assert not list(out.rglob("*.safetensors")) and not list(out.rglob(".*.tmp"))


def test_a_failing_cell_is_recorded_and_the_others_run(matrix, tmp_path):
    token = f"h3-test-{uuid.uuid4().hex}"
    out = tmp_path / "m"
    code, stdout, err = matrix("--counts", "2", *SMALL, "--no-save-latents", "--output", str(out), env={"H3_INJECT_FAULT": "step:1@1", "H3_TEST_TOKEN": token})
    assert code == 1
    assert "2 problem(s) in the matrix: ulysses x2 failed: rank 1" in one_line(err)
    report = MatrixReport.model_validate_json((out / "matrix.json").read_text())
    status = {(c.mode.value, c.count): c for c in report.cells}
    assert status[("ulysses", 1)].status is CellStatus.OK and status[("ulysses", 1)].requested is False  # the baseline
    assert status[("tensor", 1)].status is CellStatus.OK  # ran after ulysses x2 failed
    for mode in ("ulysses", "tensor"):
        failed = status[(mode, 2)]
        assert failed.status is CellStatus.FAILED and "injected fault at step 1 on rank 1" in failed.reason
        assert failed.sampling_seconds is None and failed.parity is None
    assert "failed" in stdout and "injected fault" in stdout  # the table and its notes were printed
    assert (out / "matrix.png").exists() and (out / "matrix.md").exists()
    assert not (out / "ulysses-2").exists()  # a failed cell writes no half report
    assert no_survivors(token)  # every rank of the failed cells was reaped


def test_bad_mode_variable_is_one_line_exit_2(matrix):
    code, out, err = matrix(*SMALL, env={"H3_DISTRIBUTED_MODES": "ulysses,ring"})
    assert code == 2 and out == ""
    assert "H3_DISTRIBUTED_MODES 'ulysses,ring'" in one_line(err)


def test_matrix_script_forwards_and_honours_the_seed_variables(tmp_path):
    out = tmp_path / "m"
    env = {"H3_SAVE_LATENTS": "0", "H3_GPU_COUNTS": "1", "H3_DISTRIBUTED_MODES": "tensor", "H3_DISTRIBUTED_OUTPUT": str(out)}
    proc = _script("run_distributed_matrix.sh", "--preset", "tiny", "--steps", "2", "--repeat", "1", "--json", env=env)
    assert proc.returncode == 0, proc.stderr
    report = MatrixReport.model_validate_json(proc.stdout)
    assert [(c.mode, c.count, c.status) for c in report.cells] == [(Mode.TENSOR, 1, CellStatus.OK)]
    assert report.files.directory == str(out) and (out / "matrix.png").exists() and not list(out.rglob("*.safetensors"))


def test_t2va_script_forwards_mode_count_and_attention(tmp_path):
    proc = _script("run_distributed_t2va.sh", "tensor", "1", "math", "--steps", "2", "--json", env={"H3_DISTRIBUTED_OUTPUT": str(tmp_path), "H3_SAVE_LATENTS": "0"})
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert (report["mode"], report["world_size"], report["attention"]) == ("tensor", 1, "math")
    assert (tmp_path / "report.json").exists() and not (tmp_path / "latents.safetensors").exists()


def test_t2va_script_takes_h3_world_size_when_no_count_is_given():
    # tiny has 8 heads: 9 ranks is refused before anything is spawned, which shows the variable was used
    proc = _script("run_distributed_t2va.sh", "ulysses", "--preset", "tiny", "--device", "cpu", env={"H3_WORLD_SIZE": "9"})
    assert proc.returncode == 2 and "9" in proc.stderr and "Traceback" not in proc.stderr
