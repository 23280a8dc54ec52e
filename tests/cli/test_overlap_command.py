"""`h3 generate --ulysses-overlap` (issue 34.4) as a user runs it: on is bitwise off at 2 Gloo ranks,
auto follows the documented rule (off on Gloo: not measured faster there), the report says which
and why, and --profile shows the exposed against the in-flight communication."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from h3core.generate.report import RunReport
from h3core.parallel import overlap


@pytest.fixture(scope="module")
def runs(tmp_path_factory, cache):
    from typer.testing import CliRunner

    from h3cli.main import app

    out, results = tmp_path_factory.mktemp("overlap"), {}
    for choice in ("on", "auto"):
        args = ["generate", "ulysses", "2", "--device", "cpu", "--steps", "3", "--no-decode", "--ulysses-overlap", choice, "--output", str(out / choice)]
        done = CliRunner().invoke(app, args + (["--profile"] if choice == "on" else []), env={"H3_CACHE_DIR": cache, "COLUMNS": "200"})
        assert done.exit_code == 0, done.output
        results[choice] = (load_file(out / choice / "latents.safetensors"), RunReport.model_validate_json((out / choice / "report.json").read_text()), done.output)
    return results


def test_overlap_on_is_bitwise_the_whole_all_to_all(runs):
    (on, on_report, _), (auto, auto_report, _) = runs["on"], runs["auto"]
    assert on_report.partition.overlap.groups == 2 and not auto_report.partition.overlap.on
    assert all(torch.equal(on[k], auto[k]) for k in on)
    assert on_report.comm_total.bytes_sent == auto_report.comm_total.bytes_sent  # the same bytes, in twice the messages
    assert on_report.comm_total.kinds["seq_to_head"].calls == 2 * auto_report.comm_total.kinds["seq_to_head"].calls


def test_auto_is_off_on_gloo_and_says_why(runs):
    _, report, output = runs["auto"]
    assert report.partition.overlap.reason.startswith("auto: not measured faster on gloo") and "ulysses overlap" in output


def test_the_profile_shows_exposed_against_in_flight_communication(runs):
    _, report, output = runs["on"]
    assert set(report.profile.in_flight_mean) == {"seq_to_head", "head_to_seq"}
    assert all(seconds > 0 for seconds in report.profile.in_flight_mean.values())
    assert "exposed" in output and "in flight per step" in output and "hidden" in output


def test_the_rule_is_checkable_without_a_gpu():
    """auto: on only where measured faster; on/off force it; one rank, or one head per rank, has nothing to split."""
    assert overlap.choose("auto", backend="gloo", heads_per_rank=[28, 28]).groups == 1
    assert overlap.choose("auto", backend="nccl", heads_per_rank=[28, 28]).groups == (overlap.GROUPS if overlap.MEASURED_FASTER["nccl"] else 1)
    assert overlap.choose("on", backend="gloo", heads_per_rank=[28, 28]).groups == overlap.GROUPS
    assert overlap.choose("on", backend="gloo", heads_per_rank=[1, 1]).groups == 1
    assert overlap.choose("on", backend="gloo", heads_per_rank=[56]).groups == 1
    assert overlap.choose("off", backend="nccl", heads_per_rank=[7] * 8).groups == 1


def test_a_bad_overlap_flag_is_one_line_exit_2(h3):
    code, out, err = h3("generate", "--ulysses-overlap", "sometimes")
    assert code == 2 and "--ulysses-overlap" in err and len(err.strip().splitlines()) == 1


def test_one_overlap_group_is_refused_in_one_line(h3):
    code, out, err = h3("bench-transport", "2", "--tokens", "64", "--heads", "4", "--head-dim", "16", "--overlap-groups", "1")
    assert code == 2 and "--overlap-groups must be at least 2" in err and len(err.strip().splitlines()) == 1
