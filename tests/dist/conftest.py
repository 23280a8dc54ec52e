"""One spawned 8-rank Gloo World for the whole dist tier: starting ranks costs seconds each (every
worker imports torch), so tests share it and take sub-groups of its first ranks (`ctx.first_ranks`)
for the checks at 2, 4 and 6 ranks."""

import pytest

from h3core.runtime.world import World

DIST_RANKS = 8


@pytest.fixture(scope="session")
def world8():
    with World(DIST_RANKS, "cpu", timeout_s=120) as world:
        yield world

