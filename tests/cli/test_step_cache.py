"""The step cache (`--cache fbcache:T`, h3core.model.step_cache): its policy, its decisions, and
threshold 0 bitwise the uncached run through `h3 generate`."""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from h3cli.main import app
from h3core.generate.report import RunReport
from h3core.model.step_cache import CachePolicy, FirstBlockCache


@pytest.mark.parametrize("text, expected", [("off", "off"), ("OFF", "off"), ("fbcache:0.08", "fbcache:0.08"), ("fbcache:0", "fbcache:0"), (" fbcache:1e-1 ", "fbcache:0.1")])
def test_the_policy_reads_what_users_write(text, expected):
    assert str(CachePolicy.parse(text)) == expected


@pytest.mark.parametrize("text", ["fbcache", "fbcache:", "fbcache:x", "fbcache:-0.1", "fbcache:nan", "fbcache:inf", "teacache:0.1", ""])
def test_a_policy_it_cannot_run_is_refused(text):
    with pytest.raises(ValueError):
        CachePolicy.parse(text)


def _blocks(scale: float):
    """Block 0 adds `scale * step`-dependent noise; the rest add a fixed function of the stream (both write in place, as h3's blocks do)."""
    def first(x):
        x += scale
        return x

    def rest(x):
        x += torch.sin(x)
        return x

    return first, rest


def _steps(cache: FirstBlockCache, scales: list[float]) -> list[torch.Tensor]:
    x0 = torch.linspace(-1, 1, 12).reshape(6, 2)
    return [cache.forward(x0.clone(), *_blocks(s)) for s in scales]


def test_threshold_zero_never_skips_and_computes_what_the_blocks_compute():
    cache = FirstBlockCache(0.0, agree=lambda t: t)
    outs = _steps(cache, [1.0, 1.0, 1.0])  # block 0's residual does not move at all: still computed
    first, rest = _blocks(1.0)
    x = torch.linspace(-1, 1, 12).reshape(6, 2)
    assert cache.skipped == [] and all(torch.equal(o, rest(first(x.clone()))) for o in outs)
    assert math.isinf(cache.changes[0]) and cache.changes[1:] == [0.0, 0.0]


def test_a_small_change_reuses_the_other_blocks_residual():
    cache = FirstBlockCache(0.05, agree=lambda t: t)
    outs = _steps(cache, [1.0, 1.01, 1.5])
    assert cache.skipped == [1]  # 1% moved: skipped; 50%: computed again
    x = torch.linspace(-1, 1, 12).reshape(6, 2)
    first, rest = _blocks(1.0)
    tail = rest(first(x.clone())) - first(x.clone())
    assert torch.equal(outs[1], (x + 1.01) + tail)  # block 0 ran; blocks 1.. were its residual from step 0
    assert cache.changes[2] == pytest.approx(0.5 / 1.0, rel=1e-6)  # compared with the last computed step


def test_the_change_is_the_whole_sequences_whatever_the_split():
    """Two ranks holding half the rows each, their sums added, take the one-rank decision; one rank's
    own half alone would not (the mutation the sum over ranks prevents)."""
    head_then, head_now = torch.tensor([[1.0], [1.0], [10.0], [10.0]]), torch.tensor([[1.5], [1.5], [10.0], [10.0]])
    whole = (head_now - head_then).abs().sum() / head_then.abs().sum()
    halves = [(head_now[i:i + 2] - head_then[i:i + 2]).abs().sum() for i in (0, 2)], [head_then[i:i + 2].abs().sum() for i in (0, 2)]
    assert sum(halves[0]) / sum(halves[1]) == pytest.approx(float(whole))
    assert halves[0][0] / halves[1][0] > 0.4 > float(whole) > 0.04  # rank 0 alone would compute at 0.1; the sequence skips


@pytest.fixture(scope="module")
def runs(tmp_path_factory, cache):
    out = tmp_path_factory.mktemp("cache")
    runner = CliRunner()
    results = {}
    for name, flag in (("off", "off"), ("zero", "fbcache:0"), ("on", "fbcache:0.4")):
        done = runner.invoke(app, ["generate", "--steps", "10", "--no-decode", "--cache", flag, "--output", str(out / name)], env={"H3_CACHE_DIR": cache})
        assert done.exit_code == 0, done.output
        results[name] = (load_file(out / name / "latents.safetensors"), RunReport.model_validate_json((out / name / "report.json").read_text()))
    return results


def test_threshold_zero_is_bitwise_the_uncached_run(runs):
    (off, off_report), (zero, zero_report) = runs["off"], runs["zero"]
    assert off_report.cache is None and zero_report.cache is not None and zero_report.cache.skipped == 0
    assert all(torch.equal(off[k], zero[k]) for k in off)


def test_the_report_counts_what_was_skipped(runs):
    (off, _), (on, report) = runs["off"], runs["on"]
    record = report.cache
    assert record.policy == "fbcache:0.4" and record.steps == 9 and 0 < record.skipped < 9
    assert record.computed + record.skipped == 9 and record.sequences["prompt"].changes[0] is None
    assert not torch.equal(off["video"], on["video"])  # skipping changes the result (by how much: h3 compare)


def test_a_bad_cache_flag_is_one_line_exit_2(h3):
    code, out, err = h3("generate", "--cache", "fbcache:-1")
    assert code == 2 and "--cache" in err and "threshold" in err and len(err.strip().splitlines()) == 1
