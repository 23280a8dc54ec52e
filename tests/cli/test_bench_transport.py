"""`h3 bench-transport` end to end (small shapes) and its failure modes."""

import json
import os
import pathlib
import subprocess
import sys
import uuid

import pytest
from typer.testing import CliRunner

from h3cli.main import app
from h3core.errors import BackendUnavailable

from commands import REPO, no_survivors, one_line

runner = CliRunner()
SMALL = ["--tokens", "515", "--heads", "8", "--head-dim", "16", "--iters", "3", "--warmup", "1"]


def test_two_ranks_json_report_and_file(h3, tmp_path):
    code, out, err = h3("bench-transport", "2", *SMALL, "--json", "--output", str(tmp_path))
    assert code == 0, err
    report = json.loads(out)
    assert report["backend"] == "gloo" and report["config"]["world_size"] == 2
    assert report["tokens_per_rank"] == [258, 257] and report["heads_per_rank"] == [4, 4]
    assert report["identity_exact"] is True and report["blocks_exact"] is True and report["qkv_fused"] is True
    assert set(report["phases"]) == {
        "finish_one_rank", "finish_into_blocks", "seq_to_head", "attention", "head_to_seq",
        "seq_to_head_packed", "wire_qkv", "wire_out", "fresh_qkv", "fresh_out",
        "attend_whole", "attend_overlapped", "comm_whole", "comm_exposed", "comm_in_flight",  # issue 34.4: the overlap
    }
    overlap = report["overlap"]
    assert report["overlap_exact"] is True and overlap["groups"] == 2 and overlap["ratio_range"][0] <= overlap["ratio"] <= overlap["ratio_range"][1]
    assert overlap["comm_whole_s"] > 0 and overlap["comm_exposed_s"] > 0 and overlap["comm_in_flight_s"] > 0
    assert isinstance(report["ratio"], float) and report["ratio"] > 0 and report["target_ratio"] == 1.3
    assert report["ratio"] == pytest.approx(report["round_trip_s"] / report["wire_s"])
    assert report["packed_ratio"] > 0 and report["fresh_ratio"] > 0 and report["cpu_allocator"] in ("retain", "system")
    # rank 0 sends rank 1 its 4 heads of q|k|v for 258 tokens, fp32; the wire moves the same bytes
    for phase in ("seq_to_head", "seq_to_head_packed", "wire_qkv", "fresh_qkv"):
        assert report["phases"][phase]["bytes_sent_per_rank"][0] == 258 * 3 * 4 * 16 * 4
    written = json.loads((tmp_path / "bench-transport-2x-sdpa.json").read_text())
    assert written == report
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp file left


def test_one_rank_runs_in_process_with_no_ratio(tmp_path, monkeypatch):
    target = tmp_path / "seed.json"
    result = runner.invoke(
        app, ["bench-transport", "1", "math", "--tokens", "64", "--heads", "4", "--head-dim", "16", "--iters", "2", "--warmup", "0", "--json"],
        env={"H3_DISTRIBUTED_BENCHMARK": str(target)},
    )
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["backend"] == "none" and report["ratio"] is None
    assert report["phases"]["attention"]["median_s"] > 0
    assert json.loads(target.read_text())["config"]["attention"] == "math"


def test_table_output_names_the_ratio(h3, monkeypatch):
    monkeypatch.setenv("COLUMNS", "160")
    code, out, err = h3("bench-transport", "2", *SMALL, "--skip-attention")
    assert code == 0, err
    assert "seq to head" in out and "attention (" not in out  # --skip-attention
    assert "x the wire" in out and "plain all_to_all_single of the same bytes" in out


def test_unavailable_backend_is_one_line_exit_2(h3):
    code, out, err = h3("bench-transport", "2", "sage2", *SMALL, "--device", "cpu")
    assert code == 2 and out == ""
    assert "sage2" in one_line(err)


def test_unavailable_backend_fails_before_spawning(monkeypatch):
    import h3core.bench.transport

    def no_spawn(*args, **kwargs):
        raise AssertionError("a World was started")

    monkeypatch.setattr(h3core.bench.transport, "World", no_spawn)
    result = runner.invoke(app, ["bench-transport", "2", "sage2", *SMALL, "--device", "cpu"])
    assert isinstance(result.exception, BackendUnavailable)


@pytest.mark.parametrize(
    "args, needle",
    [
        (["bench-transport", "2", "--tokens", "64", "--width", "256"], "either --tokens or --width"),
        (["bench-transport", "9", "--tokens", "64", "--heads", "8"], "8 attention heads over 9 ranks"),
        (["bench-transport", "2", "--tokens", "64", "--dtype", "fp8"], "--dtype 'fp8': is not a dtype h3 computes in"),
    ],
)
def test_bad_requests_are_one_line_exit_2(h3, args, needle):
    code, _, err = h3(*args)
    assert code == 2, err
    assert needle in one_line(err)


@pytest.mark.skipif(not pathlib.Path("/proc/self/environ").exists(), reason="needs Linux /proc")
@pytest.mark.parametrize(
    "fault, code, needle",
    [("iter:1@1:kill", 1, "rank 1 failed: process killed by signal SIGKILL"), ("iter:0@1:config", 2, "rank 1: injected fault")],
)
def test_rank_fault_ends_the_command_with_no_survivors(h3, tmp_path, monkeypatch, fault, code, needle):
    token = f"h3-test-{uuid.uuid4().hex}"
    monkeypatch.setenv("H3_INJECT_FAULT", fault)  # the spawned ranks inherit both
    monkeypatch.setenv("H3_TEST_TOKEN", token)
    exit_code, _, err = h3("bench-transport", "2", *SMALL, "--output", str(tmp_path))
    assert exit_code == code, err
    assert needle in one_line(err)
    assert list(tmp_path.iterdir()) == []  # no report written as if successful
    assert no_survivors(token)


def test_seed_script_forwards_to_h3(tmp_path):
    bin_dir = pathlib.Path(sys.executable).parent
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}
    proc = subprocess.run(
        [str(REPO / "scripts" / "run_ulysses_benchmark.sh"), "1", "math", "--tokens", "32", "--heads", "2", "--head-dim", "16",
         "--iters", "1", "--warmup", "0", "--json"],
        capture_output=True, text=True, env=env, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["config"]["attention"] == "math"


def test_round_trip_and_wire_are_per_iteration_sums_of_the_slowest_rank():
    from h3core.bench.transport import ROUND_TRIP, WIRE, combined, target_ratio

    rank0 = {"samples": {"finish_into_blocks": [3.0, 5.0, 4.0], "finish_one_rank": [2.0, 2.0, 2.0],
                         "seq_to_head": [1.0, 1.0, 1.0], "head_to_seq": [1.0, 1.0, 1.0],
                         "wire_qkv": [1.0, 1.0, 1.0], "wire_out": [0.5, 0.5, 0.5]}}
    # rank 1 got the core first in iteration 0 and last in iteration 2: each phase waits for its slowest rank
    rank1 = {"samples": {**rank0["samples"], "finish_one_rank": [1.0, 2.0, 3.0], "wire_qkv": [2.0, 2.0, 2.0]}}
    # per iteration: slowest finish_into_blocks (3, 5, 4) - slowest finish_one_rank (2, 2, 3) + 1 + 1 = (3, 5, 3)
    assert combined([rank0, rank1], ROUND_TRIP) == 3.0  # (each rank's own median, then the max, would say 4)
    assert combined([rank0, rank1], {"finish_one_rank": 1}) == 2.0  # median of (2, 2, 3)
    assert combined([rank0, rank1], WIRE) == 2.5  # the slower rank
    assert (target_ratio(2), target_ratio(4), target_ratio(8)) == (1.3, 1.3, 1.5)
