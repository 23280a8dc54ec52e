"""`h3 plan`: the partition contract per rank, as a table or JSON; one line for what cannot be split."""

import json

import pytest
from typer.testing import CliRunner

from commands import one_line, run_main
from h3cli.main import app
from h3core.errors import PartitionError

runner = CliRunner()


def test_plan_json_heads_for_six_ranks():
    result = runner.invoke(app, ["plan", "6", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["heads"] == [10, 10, 9, 9, 9, 9]
    assert sum(data["tokens"]) == data["num_tokens"] == 17_608  # 128 text + 470 audio + 17,010 video rows
    assert data["ranks"][0]["tensor"] is None


def test_plan_tensor_table_lists_shards():
    result = runner.invoke(app, ["plan", "6", "--mode", "tensor"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "qkv_proj rows" in result.stdout and "fc2 columns" in result.stdout
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
    assert tensor["parameters"] == 20_111_438_744  # the AdaLN-pruned FL2VA transformer
    assert tensor["checkpoint_bytes"] == ulysses["checkpoint_bytes"] == 12_528_520_792  # the seed's file: 8 + header + this
    assert ulysses["per_rank"] == [12_528_520_792] * 6
    replicated = tensor["checkpoint_bytes"] - tensor["block_linears_bytes"]
    shares = [(b - replicated) / tensor["block_linears_bytes"] for b in tensor["per_rank"]]
    # 56 heads and 896 fc blocks over 6 ranks: ranks 0-1 own 10 heads and 150 blocks, the others 9 and 149
    assert shares[0] == shares[1] > shares[2] == shares[5]
    assert 1 / 6 * 0.97 < shares[5] < 1 / 6 < shares[0] < 1.05 / 6


def test_plan_shows_the_layout_groups_with_cfg_parallel_and_replicas():
    result = runner.invoke(app, ["plan", "8", "--cfg-parallel", "--replicas", "2", "--preset", "narrow"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "world 8 = 2 replicas x 2 CFG halves x 2 ranks per sequence" in result.stdout
    assert "6, 7" in result.stdout and "negative prompt (ulysses over 2)" in result.stdout
    data = json.loads(runner.invoke(app, ["plan", "8", "--cfg-parallel", "--replicas", "2", "--preset", "narrow", "--json"]).stdout)
    assert data["world_size"] == 2 and data["layout"]["world_size"] == 8  # the partition is one group's; the layout the world's
    assert [(g["replica"], g["branch"], g["ranks"], g["runs"]) for g in data["layout"]["groups"]] == [
        (0, 0, [0, 1], ["prompt"]), (0, 1, [2, 3], ["negative prompt"]), (1, 0, [4, 5], ["prompt"]), (1, 1, [6, 7], ["negative prompt"]),
    ]


@pytest.mark.parametrize("args, needle", [
    (["3", "--cfg-parallel"], "3 is odd"),
    (["6", "--replicas", "4"], "6 ranks do not split into 4 replica groups"),
    (["18", "--cfg-parallel", "--preset", "tiny"], "use at most 8 ranks per group (world 18 = 1 replica x 2 CFG halves x 9 ranks"),
])
def test_plan_refuses_a_layout_that_does_not_split_in_one_line(capsys, args, needle):
    code, _, err = run_main(capsys, "plan", *args)
    assert code == 2
    assert needle in one_line(err)


# --- every option checked before any output; no markup printed as text ---------------------------------


@pytest.mark.parametrize("args, needle", [
    (["--memory", "--arch", "sm_75"], "--arch sm_75: unknown architecture; choose one of: sm_90, sm_120, cpu"),
    (["--memory", "--arch", "sm_90", "--arch", "[red]x[/red]"], "--arch [red]x[/red]: unknown architecture"),
    (["--arch", "sm_90"], "--arch says what --memory predicts for; add --memory"),
    (["--decoded-weights", "on"], "--decoded-weights says what --memory predicts for; add --memory"),
    (["--memory", "--arch", "sm_90", "--decoded-weights", "bogus"], "--decoded-weights 'bogus': input should be 'auto', 'on' or 'off'"),
])
def test_plan_memory_options_are_checked_before_anything_is_printed(h3, args, needle):
    code, out, err = h3("plan", "2", "--preset", "tiny", *args)
    assert code == 2 and out == "" and needle in one_line(err), (out, err)


def test_a_dry_run_this_host_cannot_make_is_said_in_plain_text(h3, monkeypatch):
    import h3core.generate.dryrun.command as command

    monkeypatch.setattr(command, "dry_run_problem", lambda arch: None if arch == "cpu" else "[bold]the CUDA guard[/bold] is off")
    code, out, err = h3("plan", "2", "--preset", "tiny", "--memory", "--arch", "sm_90")
    assert code == 1 and "no dry run here: [bold]the CUDA guard[/bold] is off" in out  # literal: not markup, not swallowed
    assert "[red]" not in out and "[/red]" not in out


def test_no_markup_string_reaches_the_literal_console():
    """h3's console prints every string literally (h3cli/output.py), so a string written as rich markup
    would print its tags: h3's own styling is `styled(...)` pieces. Every string constant and f-string
    of h3cli (docstrings aside) is checked for a markup tag."""
    import ast
    import re
    from pathlib import Path

    import h3cli

    tag = re.compile(r"\[/?(?:bold|dim|italic|underline|red|green|yellow|blue|cyan|magenta|white|b|i|u|s|link[^\]]*)?\]")
    found = []
    for path in Path(h3cli.__file__).parent.glob("*.py"):
        tree = ast.parse(path.read_text())
        docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                      if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)) and node.body
                      and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                if tag.search(node.value):
                    found.append(f"{path.name}:{node.lineno}: {node.value!r}")
    assert not found, found


def test_plan_with_two_keyframes_counts_the_worked_example(h3):
    """MINIMAX_H3.md §2.6: two keyframes at 864x480, 141 frames: S = L' + 18,290, L' = the prompt's 128
    tokens + 2 x (6 label tokens + 407 vision-block tokens); a role other than first/last is one line."""
    import json

    code, out, _ = h3("plan", "8", "--keyframes", "first,last", "--text-tokens", "128", "--json")
    plan = json.loads(out)
    rows: dict[str, int] = {}
    for seg in plan["segments"]:
        rows[seg["kind"]] = rows.get(seg["kind"], 0) + seg["stop"] - seg["start"]
    assert code == 0 and rows == {"text": 954, "condition": 810, "audio": 470, "video": 17_010}
    assert plan["num_tokens"] == 954 + 18_290 and plan["tokens"] == [2406] * 4 + [2405] * 4
    assert [s["tag"] for s in plan["segments"] if s["kind"] == "text"] == [1, 0, 1, 0, 1]
    code, _, err = h3("plan", "--keyframes", "middle")
    assert code == 2 and "role 'middle' is not one of first, last" in err and len(err.strip().splitlines()) == 1
