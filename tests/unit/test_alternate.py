"""Interleaved timing (issue 34.6): the order rounds run arms in, the spread of repeated times, and
the flag on a speedup above the ideal by more than its spread (h3core.bench.alternate), as `h3
matrix --repeat` applies them to its cells (h3core.matrix.summary.rescale)."""

import pytest

from h3core.bench.alternate import NOISE, Spread, alternate, beyond_ideal, ratios, rounds
from h3core.matrix.render import split_rows, summary_rows
from h3core.matrix.report import CellStatus, MatrixCell
from h3core.matrix.summary import rescale
from h3core.parallel.modes import Mode


def test_rounds_run_every_arm_once_forward_then_backward():
    assert rounds(["a", "b", "c"], 3) == ["a", "b", "c", "c", "b", "a", "a", "b", "c"]
    assert rounds(["a"], 2) == ["a", "a"] and rounds(["a", "b"], 0) == []


def test_alternate_times_the_arms_in_interleaved_rounds_after_the_warmup():
    calls = []

    def arm(name, seconds):
        return lambda: calls.append(name) or seconds

    times = alternate({"dense": arm("dense", 2.0), "nvfp4": arm("nvfp4", 3.0)}, repeat=4, warmup=1)
    assert calls == ["dense", "nvfp4"] + ["dense", "nvfp4", "nvfp4", "dense", "dense", "nvfp4", "nvfp4", "dense"]
    assert times == {"dense": [2.0] * 4, "nvfp4": [3.0] * 4}
    assert ratios(times["nvfp4"], times["dense"]) == [1.5] * 4


def test_speedup_spread_takes_the_extremes_of_both_arms():
    baseline, cell = Spread.of([0.9, 1.0, 1.3]), Spread.of([0.5, 0.4, 0.6])
    speedup = cell.scaled_against(baseline)
    assert (speedup.min, speedup.median, speedup.max) == pytest.approx((0.9 / 0.6, 1.0 / 0.5, 1.3 / 0.4))


@pytest.mark.parametrize("median, low, high, ideal, flagged", [
    (19.6, 19.6, 19.6, 2, True),   # the "ulysses 2 ranks: speedup 19.60" from one run: no spread explains it
    (2.5, 1.0, 4.0, 2, False),     # above the ideal, but within its own spread: noisy, not impossible
    (2.5, 2.2, 2.6, 2, True),      # above the ideal by 0.5, spread 0.4
    (1.8, 1.8, 1.8, 2, False),     # below the ideal: scaling
    (2.0, 2.0, 2.0, 2, False),     # exactly ideal
])
def test_a_speedup_above_the_ideal_by_more_than_its_spread_is_noise(median, low, high, ideal, flagged):
    assert beyond_ideal(Spread(min=low, median=median, max=high), ideal) is flagged


def test_beyond_ideal_without_a_speedup_is_not_flagged():
    assert beyond_ideal(None, 2) is False


def _cell(count, profile_compute=None):
    split = {"attention": profile_compute, "step": 1.0} if profile_compute is not None else None
    return MatrixCell(mode=Mode.ULYSSES, count=count, requested=True, status=CellStatus.OK, split=split)


def test_matrix_flags_the_stalled_baseline_in_the_table_and_the_json():
    """The issue's run: the 1-rank cell's threads stalled under load (0.97 s a step against 0.011 s)."""
    cells = [_cell(1, profile_compute=0.9), _cell(2, profile_compute=0.019)]
    rescale(cells, {0: [0.97, 0.96, 0.98], 1: [0.049, 0.050, 0.051]})
    one, two = cells
    assert one.speedup == 1.0 and not one.noise
    assert two.noise and two.speedup == pytest.approx(0.97 / 0.050) and two.step_seconds == 0.050
    assert two.step_seconds_runs == [0.049, 0.050, 0.051] and two.speedup_spread.min == pytest.approx(0.96 / 0.051)
    assert NOISE in summary_rows_of(cells)[1][5] and NOISE not in summary_rows_of(cells)[0][5]
    assert two.model_dump(mode="json")["noise"] is True
    assert split_rows_of(cells)[1][-1].endswith(NOISE)  # the compute speedup (one profiled run) 0.9 / 0.019


def test_matrix_keeps_a_noisy_but_plausible_speedup_unflagged():
    cells = [_cell(1), _cell(2)]
    rescale(cells, {0: [1.0, 0.6, 1.4], 1: [0.45, 0.5, 0.55]})
    assert cells[1].speedup == pytest.approx(2.0) and not cells[1].noise


def summary_rows_of(cells):
    return summary_rows(_report(cells))


def split_rows_of(cells):
    return split_rows(_report(cells))


def _report(cells):
    from types import SimpleNamespace

    return SimpleNamespace(cells=cells)
