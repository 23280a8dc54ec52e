import json
import subprocess
import sys

from typer.testing import CliRunner

from h3cli.main import app

runner = CliRunner()


def test_plan_json_heads_for_six_ranks():
    result = runner.invoke(app, ["plan", "6", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["heads"] == [10, 10, 9, 9, 9, 9]
    assert sum(data["tokens"]) == data["num_tokens"] == 14855
    assert data["ranks"][0]["tensor"] is None


def test_plan_tensor_table_lists_shards():
    result = runner.invoke(app, ["plan", "6", "--mode", "tensor"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "QKV rows" in result.stdout and "FC2 columns" in result.stdout
    assert "6016:7168 | 13184:14336 | 20352:21504" in result.stdout


def test_plan_tensor_json_has_block_aligned_columns():
    data = json.loads(runner.invoke(app, ["plan", "6", "--mode", "tensor", "--preset", "narrow", "--json"]).stdout)
    fc2 = [r["tensor"]["fc2_columns"]["scale_columns"] for r in data["ranks"]]
    assert [c["stop"] - c["start"] for c in fc2] == [13, 13, 12, 12, 12, 12]


def test_plan_uses_h3_world_size_when_no_count():
    data = json.loads(runner.invoke(app, ["plan", "--json"], env={"H3_WORLD_SIZE": "4"}).stdout)
    assert data["world_size"] == 4


def test_plan_57_fails_with_one_line_and_exit_2():
    proc = subprocess.run([sys.executable, "-m", "h3cli.main", "plan", "57"], capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "56 attention heads" in lines[0] and "57" in lines[0]
    assert "Traceback" not in proc.stderr


def test_bad_env_value_is_one_line():
    proc = subprocess.run(
        [sys.executable, "-m", "h3cli.main", "plan"], capture_output=True, text=True, env={"H3_WORLD_SIZE": "six", "PATH": ""}
    )
    assert proc.returncode == 2 and "H3_WORLD_SIZE='six'" in proc.stderr and "Traceback" not in proc.stderr


def test_debug_variable_shows_the_traceback():
    import os

    env = {**os.environ, "H3_DEBUG": "1"}
    proc = subprocess.run([sys.executable, "-m", "h3cli.main", "plan", "57"], capture_output=True, text=True, env=env)
    assert proc.returncode != 0 and "Traceback" in proc.stderr


def test_version_and_help():
    assert runner.invoke(app, ["--version"]).stdout.startswith("h3 ")
    assert "plan" in runner.invoke(app, ["--help"]).stdout


def test_plan_reports_model_size_and_weights_per_rank():
    tensor = json.loads(runner.invoke(app, ["plan", "6", "--mode", "tensor", "--json"]).stdout)["weights"]
    ulysses = json.loads(runner.invoke(app, ["plan", "6", "--json"]).stdout)["weights"]
    assert tensor["parameters"] == 22_247_936_768
    assert tensor["checkpoint_bytes"] == ulysses["checkpoint_bytes"] == 12_533_360_944
    assert ulysses["per_rank"] == [12_533_360_944] * 6
    replicated = tensor["checkpoint_bytes"] - tensor["block_linears_bytes"]
    shares = [(b - replicated) / tensor["block_linears_bytes"] for b in tensor["per_rank"]]
    # 56 heads and 672 FC blocks over 6 ranks: ranks 0-1 own 10 heads, the others 9
    assert shares[0] == shares[1] > shares[2] == shares[5]
    assert 1 / 6 * 0.97 < shares[5] < 1 / 6 < shares[0] < 1.05 / 6
