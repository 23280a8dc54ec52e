"""The rank layout (replicas x CFG halves x degree): rank <-> coordinates, groups, one-line refusals,
and plans/reports written before layouts existed still read as one group."""

import re

import pytest

from h3core.errors import LayoutError
from h3core.model.config import preset
from h3core.parallel.layout import CFG_NEEDS_GUIDANCE, RankLayout
from h3core.parallel.modes import Mode
from h3core.parallel.plan import ParallelPlan


def test_degree_is_innermost_and_every_rank_has_one_place():
    layout = RankLayout.of(12, cfg_parallel=True, replicas=2, guided=True)  # 2 x 2 x 3
    assert (layout.replicas, layout.cfg, layout.degree, layout.world_size) == (2, 2, 3, 12)
    coords = [layout.coords(r) for r in range(12)]
    assert [layout.rank_of(c.replica, c.branch, c.local) for c in coords] == list(range(12))
    assert (coords[4].replica, coords[4].branch, coords[4].local) == (0, 1, 1)
    assert (coords[9].replica, coords[9].branch, coords[9].local) == (1, 1, 0)
    assert layout.sequence_ranks() == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]
    assert layout.cfg_ranks() == [[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11]]
    assert [g.runs for g in layout.groups] == [["prompt"], ["negative prompt"]] * 2


def test_without_cfg_parallel_a_group_runs_both_sequences_and_there_are_no_halves():
    layout = RankLayout.of(8, replicas=2, guided=True)
    assert layout.degree == 4 and layout.cfg_ranks() == []
    assert [(g.ranks, g.runs) for g in layout.groups] == [([0, 1, 2, 3], ["prompt", "negative prompt"]), ([4, 5, 6, 7], ["prompt", "negative prompt"])]
    assert RankLayout.of(1).groups[0].runs == ["prompt"]


@pytest.mark.parametrize("world, kwargs, needle", [
    (4, dict(cfg_parallel=True), CFG_NEEDS_GUIDANCE),
    (5, dict(cfg_parallel=True, guided=True), "5 is odd: give an even rank count"),
    (6, dict(cfg_parallel=True, guided=True, replicas=2), "6 ranks do not split into 2 replica groups of two CFG halves each: give a multiple of 4"),
    (7, dict(replicas=2), "give a multiple of 2 ranks"),
])
def test_a_layout_that_cannot_apply_is_one_line(world, kwargs, needle):
    with pytest.raises(LayoutError, match=re.escape(needle)):
        RankLayout.of(world, **kwargs)


def test_a_plan_without_a_layout_reads_as_one_group_of_its_ranks():
    cfg = preset("tiny")
    plan = ParallelPlan.build(cfg, 4, Mode.ULYSSES, cfg.segments(cfg.width, cfg.height, cfg.frames, 7))
    assert plan.layout == RankLayout(degree=4)
    old = plan.model_dump(mode="json")
    del old["layout"]  # a report.json from before layouts
    assert ParallelPlan.model_validate(old).layout.groups[0].ranks == [0, 1, 2, 3]
    assert ParallelPlan.model_validate_json(plan.model_dump_json()) == plan  # the computed groups are written, and ignored when read
