"""`h3 verify` without ranks: names and counts, how measures become rows and verdicts, the report's
failure, counts a GPU machine cannot run, and the `nvfp4` check (which needs no communication) for
every rank of counts 2 and 6 through the same function the command runs on each rank."""

from __future__ import annotations

import math

import pytest
import torch

from h3core.errors import CheckFailed, ConfigError
from h3core.nvfp4 import shard
from h3core.reports.schema import Versions
from h3core.runtime.context import RankContext
from h3core.span import Span
from h3core.verify import nvfp4_layout
from h3core.verify.checks import CHECKS
from h3core.verify.rows import Measure, VerifyReport, combine, skipped
from h3core.verify.runner import build_spec, unusable_counts
from h3core.verify.spec import CHECK_NAMES, VerifyConfig, parse_checks


def test_check_names_are_validated_and_kept_in_run_order():
    assert list(CHECKS) == list(CHECK_NAMES)
    assert parse_checks([]) == list(CHECK_NAMES)
    assert parse_checks(["parity", "transport", "parity"]) == ["transport", "parity"]
    with pytest.raises(ConfigError, match="unknown check 'sdpa2'; valid checks: transport, sdpa, ragged"):
        VerifyConfig(checks=["sdpa2"])


def test_counts_are_sorted_unique_and_positive():
    assert VerifyConfig(counts=[8, 2, 2, 6]).counts == [2, 6, 8]
    with pytest.raises(ConfigError, match="--counts"):
        VerifyConfig(counts=[0, 2])
    with pytest.raises(ConfigError, match="unknown preset"):
        VerifyConfig(preset="huge")


def test_the_narrow_sequence_divides_by_no_default_count():
    spec = build_spec(VerifyConfig(device="cpu"), "cpu")
    assert spec.segment_sizes == {"text": spec.text_tokens, "audio": 74, "video": 84} and spec.text_tokens > 0
    assert all(spec.num_tokens % count for count in (2, 4, 6, 8))
    assert spec.dtype == "fp32"


def m(variant: str, max_abs: float, scale: float, tol: float, **extra) -> Measure:
    return Measure(variant=variant, max_abs=max_abs, scale=scale, tolerance=tol, seconds=1.0, **extra)


def test_rows_take_the_worst_rank_and_the_global_reference_scale():
    per_rank = [[m("a", 1e-7, 2.0, 1e-6), m("b", 0.0, 1.0, 0.0)], [m("a", 4e-7, 0.5, 1e-6), m("b", 0.0, 3.0, 0.0)]]
    a, b = combine("tp", 2, "gloo", "fp32", per_rank)
    assert (a.mode, a.max_abs, a.relative, a.verdict) == ("a", 4e-7, 2e-7, "pass")
    assert (b.max_abs, b.relative, b.tolerance, b.verdict, b.seconds) == (0.0, 0.0, 0.0, "pass", 1.0)


@pytest.mark.parametrize(
    "measure, reason",
    [
        (m("x", 1e-9, 1.0, 0.0), "exceeds bitwise equality"),
        (m("x", 2e-5, 1.0, 1e-5, worst="block 1"), "relative error 2e-05 exceeds tolerance 1e-05 (worst: block 1)"),
        (m("x", math.nan, 1.0, 1.0), "NaN"),
        (m("x", 0.0, 1.0, 1.0, mismatches=["blocks.0.attn.qkv (disk): 3 packed weight bytes differ"]), "3 packed weight bytes"),
    ],
)
def test_what_fails(measure, reason):
    (row,) = combine("c", 2, "gloo", "fp32", [[measure]])
    assert row.verdict == "fail" and reason in row.reason


def _report(rows) -> VerifyReport:
    return VerifyReport(
        created="t", passed=not any(r.verdict == "fail" for r in rows), device="cpu", device_name="cpu",
        dist_backend="gloo", dtype="fp32", world_size=2, counts=[2], checks=["ragged"], preset="narrow",
        num_tokens=147, segments={}, steps=2, seed=0, rows=rows, spawn_seconds=0, seconds=0,
        report_path="out/verify.json", versions=Versions(),
    )


def test_the_failure_names_the_failing_rows_and_skips_do_not_fail():
    rows = combine("ragged", 2, "gloo", "fp32", [[m("gather_rows", 0, 1, 0), m("reduce_scatter_rows", 0.5, 1, 0)]])
    rows.append(skipped("ragged", "gather_rows", 4, "fp32", "needs 4 GPUs, 1 visible"))
    failure = _report(rows).failure()
    assert isinstance(failure, CheckFailed) and failure.exit_code == 1
    assert "1 verify row(s) failed: ragged reduce_scatter_rows at 2 rank(s)" in str(failure)
    assert "out/verify.json" in str(failure)
    assert _report(rows[:1] + rows[2:]).failure() is None


def test_counts_above_the_visible_gpus_are_unusable(monkeypatch):
    import h3core.runtime.device

    monkeypatch.setattr(h3core.runtime.device, "visible_gpu_count", lambda: 1)
    assert unusable_counts([1, 2, 8], "cuda") == {2: "needs 2 GPUs, 1 visible", 8: "needs 8 GPUs, 1 visible"}
    assert unusable_counts([1, 2, 8], "cpu") == {}


# --- nvfp4: every rank's shards, no communication needed -------------------------------------------------


@pytest.fixture(scope="module")
def spec():
    return build_spec(VerifyConfig(device="cpu"), "cpu")


def rank_contexts(world_size: int) -> list[RankContext]:
    return [RankContext(rank, world_size, 0, torch.device("cpu"), None, "none") for rank in range(world_size)]


def nvfp4_rows(spec, world_size: int):
    return combine("nvfp4", world_size, "none", "fp32", [nvfp4_layout.measure_nvfp4(ctx, spec) for ctx in rank_contexts(world_size)])


@pytest.mark.parametrize("world_size", [2, 6])
def test_nvfp4_shards_of_every_rank_are_byte_slices(spec, world_size):
    rows = nvfp4_rows(spec, world_size)
    assert [r.mode for r in rows] == ["column-parallel", "row-parallel"]
    assert all(r.verdict == "pass" and r.max_abs == 0 and r.tolerance == 0 for r in rows)


def test_nvfp4_a_shard_cut_one_block_off_fails_with_the_bytes_that_differ(spec, monkeypatch):
    def off_by_one_block(linear, rows):  # every row span shifted down one row: wrong bytes, wrong values
        return shard.column_parallel(linear, [Span(s.start + 1, s.stop + 1) if s.stop < linear.out_features else s for s in rows])

    monkeypatch.setattr(nvfp4_layout, "column_parallel", off_by_one_block)
    column, row = nvfp4_rows(spec, 2)
    assert column.verdict == "fail" and column.max_abs > 0 and "packed weight bytes differ" in column.reason
    assert "(memory)" in column.reason and "(disk)" not in column.reason  # the disk reader is still right
    assert row.verdict == "pass"
