"""`h3 verify` as a command: a real run on Gloo ranks, JSON and the report file, the exit code of a
failing check (a reduce-scatter broken inside the ranks), and argument errors before any spawn."""

from __future__ import annotations

import json
from dataclasses import replace

from typer.testing import CliRunner

from commands import one_line
from h3cli.main import app
from h3core.errors import ConfigError
from h3core.verify.checks import CHECKS
from h3core.verify.session import at_each_count
from mutations import ragged_with_broken_reduce_scatter

runner = CliRunner()


def test_transport_at_two_ranks_prints_json_rows_and_writes_the_report(h3, tmp_path, monkeypatch):
    # The report folder comes from H3_DISTRIBUTED_OUTPUT when --output is not given.
    monkeypatch.setenv("H3_DISTRIBUTED_OUTPUT", str(tmp_path))
    code, out, err = h3("verify", "transport", "--counts", "2", "--device", "cpu", "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["passed"] is True and report["checks"] == ["transport"] and report["world_size"] == 2
    (row,) = report["rows"]
    assert row["check"] == "transport" and row["count"] == 2 and row["backend"] == "gloo" and row["dtype"] == "fp32"
    assert row["verdict"] == "pass" and row["max_abs"] == 0.0 and row["relative"] == 0.0 and row["tolerance"] == 0.0
    written = json.loads((tmp_path / "verify.json").read_text())
    assert written == report and report["report_path"] == str(tmp_path / "verify.json")
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp file left


def test_table_names_every_row_and_the_totals(tmp_path):
    result = runner.invoke(app, ["verify", "transport", "--counts", "1", "--device", "cpu", "-o", str(tmp_path)], env={"COLUMNS": "120"})
    assert result.exit_code == 0, result.output
    assert "transport" in result.stdout and "seq->head->seq" in result.stdout
    assert "1 passed, 0 failed, 0 skipped" in result.stdout and str(tmp_path / "verify.json") in result.stdout
    assert json.loads((tmp_path / "verify.json").read_text())["rows"][0]["backend"] == "none"


def test_unknown_check_is_one_line_exit_2(h3):
    code, out, err = h3("verify", "transport", "paritee")
    assert code == 2 and out == ""
    line = one_line(err)
    assert "unknown check 'paritee'" in line
    assert "transport, sdpa, ragged, projection, tp, nvfp4, parity, backends" in line


def test_argument_errors_come_before_any_rank_is_started(monkeypatch):
    import h3core.runtime.world

    def no_spawn(*args, **kwargs):
        raise AssertionError("a World was started")

    monkeypatch.setattr(h3core.runtime.world, "World", no_spawn)
    for args in (["verify", "paritee"], ["verify", "--counts", "2,x"], ["verify", "--preset", "huge"], ["verify", "--device", "tpu"]):
        result = runner.invoke(app, args)
        assert isinstance(result.exception, ConfigError), (args, result.exception)


# --- a broken piece fails the command -----------------------------------------------------------------------


def test_a_failing_check_exits_1_with_the_error_and_still_writes_the_report(h3, tmp_path, monkeypatch):
    broken = replace(CHECKS["ragged"], run=at_each_count(ragged_with_broken_reduce_scatter))
    monkeypatch.setitem(CHECKS, "ragged", broken)
    code, out, err = h3("verify", "ragged", "--counts", "2", "--device", "cpu", "--json", "--output", str(tmp_path))
    assert code == 1
    report = json.loads(out)
    gather, reduce_scatter = report["rows"]
    assert gather["verdict"] == "pass"
    assert reduce_scatter["verdict"] == "fail" and reduce_scatter["max_abs"] > 1 and reduce_scatter["relative"] > 0.1
    assert report["passed"] is False and json.loads((tmp_path / "verify.json").read_text()) == report
    line = one_line(err)
    assert "ragged reduce_scatter_rows at 2 rank(s)" in line and "exceeds bitwise equality" in line
