"""`h3 plan`: the partition contract per rank, as a table or JSON; one line for what cannot be split."""

import json

import pytest
from typer.testing import CliRunner

from commands import one_line
from h3cli.main import app
from h3core.errors import PartitionError

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


def test_plan_57_fails_with_one_line_and_exit_2(h3):
    code, out, err = h3("plan", "57")
    assert code == 2
    assert out == ""
    line = one_line(err)
    assert "56 attention heads" in line and "57" in line


def test_bad_env_value_is_one_line(h3, monkeypatch):
    monkeypatch.setenv("H3_WORLD_SIZE", "six")
    code, _, err = h3("plan")
    assert code == 2 and "H3_WORLD_SIZE='six'" in one_line(err)


def test_debug_variable_shows_the_traceback(h3, monkeypatch):
    monkeypatch.setenv("H3_DEBUG", "1")  # main lets the error through: Python prints its traceback
    with pytest.raises(PartitionError, match="56 attention heads"):
        h3("plan", "57")


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
