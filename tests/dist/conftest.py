"""One spawned 8-rank Gloo World for the whole dist tier: starting ranks costs seconds each (every
worker imports torch), so tests share it and take sub-groups of its first ranks (`ctx.first_ranks`)
for the checks at 2, 4 and 6 ranks."""

import pytest

from h3core.launch import World

DIST_RANKS = 8


@pytest.fixture(scope="session")
def world8():
    with World(DIST_RANKS, "cpu", timeout_s=120) as world:
        yield world


@pytest.fixture(scope="session")
def world6(world8):
    """The verify checks run at 2 and 6 ranks (56 heads and the narrow preset's 74 NVFP4 blocks
    are both ragged over 6); they take those counts as sub-groups of the shared World."""
    return world8
