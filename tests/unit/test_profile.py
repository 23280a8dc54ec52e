"""h3core.generate.profile: exclusive time per category, splits that add up to the step, nothing when off."""

import time

import torch
from torch import nn

from h3core.generate.profile import CATEGORIES, Profiler, RunProfile, mean_split, profiling, shares
from h3core.model.attention import AttentionKernel
from h3core.nvfp4.linear import NVFP4Linear
from h3core.parallel import collectives


class _SlowCore(AttentionKernel):
    def forward(self, q, k, v):
        time.sleep(0.03)
        return super().forward(q, k, v)


class _Slow(nn.Module):
    """A linear and an attention core whose forwards take known times, and a 'collective' in between."""

    def __init__(self, stats):
        super().__init__()
        self.linear = NVFP4Linear.from_float(torch.randn(16, 32))
        self.core = _SlowCore("math")
        self.stats = stats

    def forward(self, x):
        with self.stats.timer("gather_rows") if self.stats.timer else _null():
            time.sleep(0.02)
        h = self.linear(x)  # [S, 16]
        q = h.view(-1, 2, 8)
        return self.core(q, q, q)


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_a_step_splits_into_its_regions_and_adds_up():
    stats = collectives.CommStats()  # the rank's counters: the profiler times the collectives counting into them
    model = _Slow(stats)
    with profiling(model, torch.device("cpu"), rank=3, enabled=True, stats=stats) as profiler:
        for _ in range(2):
            with profiler.step():
                model(torch.randn(5, 32))
                time.sleep(0.01)  # outside every region: the rest
    profile = profiler.result()
    assert profile.rank == 3 and profile.clock == "perf_counter" and len(profile.steps) == 2
    for split in profile.steps:
        assert abs(sum(split[c] for c in CATEGORIES) - split["step"]) < 1e-9
        assert 0.03 <= split["attention"] < 0.06
        assert 0.02 <= split["gather_rows"] < 0.05
        assert split["rest"] >= 0.01 and split["nvfp4_linears"] > 0
    assert stats.timer is None and not model.linear._forward_hooks  # detached


def test_nested_regions_count_once_in_the_innermost():
    profiler = Profiler(torch.device("cpu"))
    with profiler.step():
        with profiler.region("seq_to_head"):
            time.sleep(0.01)
            with profiler.region("attention"):
                time.sleep(0.03)
    split = profiler.steps[0]
    assert 0.03 <= split["attention"] < 0.05
    assert 0.01 <= split["seq_to_head"] < 0.03  # its own 10 ms, not the 40 ms it spans


def test_regions_outside_a_step_are_ignored_and_off_registers_nothing():
    stats = collectives.CommStats()
    model = _Slow(stats)
    with profiling(model, torch.device("cpu"), rank=0, enabled=False, stats=stats) as profiler:
        assert profiler is None and stats.timer is None
        assert not model.linear._forward_pre_hooks
    live = Profiler(torch.device("cpu")).attach(model, stats)
    model(torch.randn(2, 32))  # no step open
    assert live.steps == [] and live._regions == []
    live.detach()


def test_run_profile_means_and_shares():
    steps = [{"attention": 1.0, "rest": 1.0, "step": 2.0}, {"attention": 3.0, "rest": 1.0, "step": 4.0}]
    from h3core.generate.profile import RankProfile

    run = RunProfile.of([RankProfile(rank=0, clock="perf_counter", steps=steps)])
    assert run.mean["attention"] == 2.0 and run.steady_mean["attention"] == 3.0
    assert mean_split([{"a": 1.0}, {}]) == {"a": 0.5}
    assert [(n, s) for n, s, _ in shares(run.mean)][:1] == [("attention", 2.0)]
