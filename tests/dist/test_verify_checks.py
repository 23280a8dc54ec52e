"""`h3 verify`'s checks on spawned Gloo ranks: the same `Check.run` the command calls, on one shared
World, at 2 and 6 ranks (56 heads and the narrow preset's 74 NVFP4 blocks are ragged over 6;
its 147 tokens divide by neither). Broken pieces, patched inside the ranks, must make them fail."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

import h3core.model.dit
import h3core.parallel.partition
import h3core.parallel.modes.tensor
from h3core.generate.parity import layer_tolerance, tolerance
from h3core.nvfp4.layout import ColumnSlice
from h3core.parallel.modes import Mode
from h3core.runtime.world import World
from h3core.span import Span
from h3core.verify.checks import CHECKS
from h3core.verify.layers import measure_projection, measure_tp
from h3core.verify.runner import build_spec
from h3core.verify.session import Session, at_each_count
from h3core.verify.spec import VerifyConfig

from mutations import dropping_last_rank, ragged_with_broken_reduce_scatter

COUNTS = [2, 6]


@pytest.fixture(scope="module")
def spec():
    return build_spec(VerifyConfig(device="cpu", steps=2), "cpu")


@pytest.fixture(scope="module")
def session(world8, spec):
    return Session(world8, spec, COUNTS, unusable={})


def run_check(session: Session, name: str):
    return CHECKS[name].run(session, CHECKS[name])


def assert_all_pass(rows, variants):
    assert [(r.mode, r.count) for r in rows] == [(v, c) for c in COUNTS for v in variants]
    for row in rows:
        assert row.verdict == "pass", row
        assert row.backend == "gloo" and row.dtype == "fp32"
        assert math.isfinite(row.max_abs) and 0 <= row.relative <= row.tolerance
        assert row.seconds > 0


@pytest.mark.parametrize("name", ["transport", "ragged", "sdpa", "projection", "tp"])
def test_check_passes_at_2_and_6_ranks(session, spec, name):
    check = CHECKS[name]
    rows = run_check(session, name)
    assert_all_pass(rows, check.variants)
    if name in ("transport", "ragged"):  # data movement: bitwise by contract
        assert all(r.tolerance == 0 and r.max_abs == 0 for r in rows)
    if name == "tp":  # one layer: SAFETY x delta x eps, no amplification
        assert all(r.tolerance == layer_tolerance(Mode.TENSOR, torch.float32) for r in rows)


def test_parity_both_modes_and_the_one_rank_identity(session):
    """t2va's rows, then the same for a first + last keyframe request (FL2VA)."""
    rows = run_check(session, "parity")
    assert len(rows) == 10
    for task, (identity, *distributed) in (("", rows[:5]), (" fl2va", rows[5:])):
        assert (identity.mode, identity.count, identity.backend) == ("tensor = ulysses" + task, 1, "none")
        assert identity.verdict == "pass" and identity.max_abs == 0 and identity.tolerance == 0
        assert [(r.mode, r.count) for r in distributed] == [(m + task, c) for c in (2, 6) for m in ("ulysses", "tensor")]
    distributed = [r for r in rows if r.count > 1]
    for row in distributed:
        assert row.verdict == "pass" and row.relative <= row.tolerance, row
    assert {r.tolerance for r in distributed if r.mode.startswith("tensor")} == {tolerance(Mode.TENSOR, torch.float32)}


def test_backends_math_runs_and_cuda_backends_are_skipped_with_the_reason(session):
    rows = {r.mode: r for r in run_check(session, "backends")}
    assert rows["math attention"].verdict == "pass" and rows["math latents"].verdict == "pass"
    for name in ("sage2", "flash"):
        for what in ("attention", "latents"):
            row = rows[f"{name} {what}"]
            assert row.verdict == "skip" and name in row.reason and row.max_abs is None


# --- broken pieces, patched inside every rank -----------------------------------------------------------


def _tp_with_broken_reduce_scatter(ctx, spec):
    with dropping_last_rank(h3core.parallel.modes.tensor):
        return measure_tp(ctx, spec)


def test_a_reduce_scatter_that_drops_a_rank_fails_ragged_with_the_error(world8, spec):
    session = Session(world8, spec, [2], unusable={})
    broken = replace(CHECKS["ragged"], run=at_each_count(ragged_with_broken_reduce_scatter))
    gather, reduce_scatter = broken.run(session, broken)
    assert gather.verdict == "pass"
    assert reduce_scatter.verdict == "fail" and reduce_scatter.max_abs > 1 and reduce_scatter.relative > 0.1
    assert "exceeds bitwise equality" in reduce_scatter.reason
    # the World is intact after the patch: the real check passes again
    assert all(r.verdict == "pass" for r in CHECKS["ragged"].run(session, CHECKS["ragged"]))


def test_a_reduce_scatter_that_drops_a_rank_fails_tp(world8, spec):
    session = Session(world8, spec, [2], unusable={})
    broken = replace(CHECKS["tp"], run=at_each_count(_tp_with_broken_reduce_scatter))
    rows = broken.run(session, broken)
    assert [r.mode for r in rows] == ["attention", "mlp"]
    for row in rows:
        assert row.verdict == "fail" and row.relative > 1000 * row.tolerance and "exceeds tolerance" in row.reason, row


# --- real bugs exceed the derived bounds by orders of magnitude ----------------------------------------


def _tp_with_qkv_thirds_swapped(ctx, spec):
    """qkv_proj's shard takes this rank's k rows as its q and q as its k: what reading per-head
    interleaved rows as stacked (or the reverse) does to a tensor-parallel rank."""
    real = h3core.parallel.partition.fused_qkv_rows

    def swapped(heads, num_heads, head_dim):
        q, k, v = real(heads, num_heads, head_dim)
        return [k, q, v]

    h3core.parallel.partition.fused_qkv_rows = swapped
    try:
        return measure_tp(ctx, spec)
    finally:
        h3core.parallel.partition.fused_qkv_rows = real


def _tp_with_a_misaligned_shard(ctx, spec):
    """fc1's rows for this rank's fc2 columns cut one NVFP4 block (16 features) off from fc2's."""
    real = h3core.parallel.partition.gate_up_rows

    def shifted(columns, ffn_dim):
        e = columns.elements
        step = 16 if e.stop + 16 <= ffn_dim else -16
        return real(ColumnSlice(Span(e.start + step, e.stop + step)), ffn_dim)

    h3core.parallel.partition.gate_up_rows = shifted
    try:
        return measure_tp(ctx, spec)
    finally:
        h3core.parallel.partition.gate_up_rows = real


def _projection_with_a_wrong_segment(ctx, spec):
    """On each rank's own rows, the final layer reads the video and audio clocks' modulation rows the
    wrong way round (a segment-to-timestep mix-up); the single-rank reference (all rows) is left correct."""
    final = h3core.model.dit.FinalLayer
    real = final.forward

    def mixed_up(self, x, cond, seq, clocks):
        if x.shape[0] == spec.num_tokens:
            return real(self, x, cond, seq, clocks)
        swapped = {"video": clocks.index["audio"], "audio": clocks.index["video"]}
        return real(self, x, cond, seq, replace(clocks, index=swapped))

    final.forward = mixed_up
    try:
        return measure_projection(ctx, spec)
    finally:
        final.forward = real


@pytest.mark.parametrize(
    "check, broken, variants",
    [
        ("tp", _tp_with_qkv_thirds_swapped, ["attention"]),
        ("tp", _tp_with_a_misaligned_shard, ["mlp"]),
        ("projection", _projection_with_a_wrong_segment, ["final layer"]),
    ],
)
def test_real_bugs_exceed_the_bounds_by_orders_of_magnitude(world8, spec, check, broken, variants):
    session = Session(world8, spec, [2], unusable={})
    mutated = replace(CHECKS[check], run=at_each_count(broken))
    rows = {row.mode: row for row in mutated.run(session, mutated)}
    for variant in variants:
        row = rows[variant]
        print(f"{broken.__name__}: {variant} relative {row.relative:.3g}, bound {row.tolerance:.3g}")
        assert row.verdict == "fail" and row.relative > 1000 * row.tolerance, row


# --- one GPU: only the one-rank rows run ------------------------------------------------------------------


def test_counts_that_cannot_run_are_skipped_and_the_identity_row_still_runs(spec):
    """What one GPU sees: counts above it skipped as 'needs N GPUs', the one-rank identity checked."""
    unusable = {2: "needs 2 GPUs, 1 visible", 4: "needs 4 GPUs, 1 visible"}
    with World(1, "cpu") as world:  # world size 1: runs in this process, nothing is spawned
        session = Session(world, spec, [2, 4], unusable)
        transport = run_check(session, "transport")
        parity = run_check(session, "parity")
    assert [(r.verdict, r.count, r.reason) for r in transport] == [("skip", 2, unusable[2]), ("skip", 4, unusable[4])]
    assert parity[0].mode == "tensor = ulysses" and parity[0].verdict == "pass" and parity[0].max_abs == 0
    assert [(r.mode, r.count, r.verdict) for r in parity[1:5]] == [
        ("ulysses", 2, "skip"), ("tensor", 2, "skip"), ("ulysses", 4, "skip"), ("tensor", 4, "skip"),
    ]
    assert parity[5].mode == "tensor = ulysses fl2va" and parity[5].verdict == "pass" and parity[5].max_abs == 0
    assert [(r.mode, r.count, r.verdict) for r in parity[6:]] == [
        ("ulysses fl2va", 2, "skip"), ("tensor fl2va", 2, "skip"), ("ulysses fl2va", 4, "skip"), ("tensor fl2va", 4, "skip"),
    ]
