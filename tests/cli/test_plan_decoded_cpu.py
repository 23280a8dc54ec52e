"""`h3 plan --memory --arch cpu` shows the CPU's decoded-weights decision, its bytes and why (issue 34.7)."""

from typer.testing import CliRunner

from h3cli.main import app

runner = CliRunner()


def test_the_cpu_plan_says_the_nvfp4_linears_are_held_decoded_and_what_they_cost():
    result = runner.invoke(app, ["plan", "2", "--preset", "tiny", "--memory", "--arch", "cpu"], env={"COLUMNS": "400"})
    assert result.exit_code == 0, result.output
    line = next(row for row in result.stdout.splitlines() if row.startswith("decoded weights"))
    assert "held: 8 NVFP4 linears" in line and "1.15 MiB per rank" in line  # float32: 4 bytes a weight
    assert "auto (cpu-dequant decodes every forward)" in line and "fit beside the run's need" in line
    off = runner.invoke(app, ["plan", "2", "--preset", "tiny", "--memory", "--arch", "cpu", "--decoded-weights", "off"], env={"COLUMNS": "400"})
    assert "not held: 8 NVFP4 linears" in off.stdout and "turned off (--decoded-weights off)" in off.stdout
