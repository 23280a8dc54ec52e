"""One spawned Gloo World for the whole dist tier: starting ranks costs seconds each (every worker
imports torch), so tests share it and take sub-groups of its first ranks (`ctx.first_ranks`)."""

import pytest

from h3core.launch import World

DIST_RANKS = 6
"""6 ranks: 56 heads and the narrow preset's 74 NVFP4 blocks are both ragged over 6."""


@pytest.fixture(scope="session")
def world6():
    with World(DIST_RANKS, "cpu", timeout_s=120) as world:
        yield world
