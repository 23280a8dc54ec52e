"""`VideoTiles`: the tiled decode as units and their blend, bit for bit diffusers' `decode` (one
process; the ranks' version is tests/dist/test_decode_spread.py), and how units are shared out."""

from __future__ import annotations

import pytest
import torch

from h3core.decode.memory import estimate_decode_memory
from h3core.decode.clip import decode_video, denormalized_video, to_pixels
from h3core.decode.run import Decoders
from h3core.decode.tiles import owners, shares
from h3core.decode.tiles import VideoTiles


@pytest.fixture(scope="module")
def decoders():
    return Decoders.load(device="cpu")


# (latent frames, h, w): one window, one tile; two windows of 2 x 2 tiles; one window of 2 x 2 tiles whose overlaps exceed what a tile keeps
@pytest.mark.parametrize("shape", [(7, 8, 10), (12, 18, 22), (7, 17, 17)], ids=["one-tile", "two-windows-tiled", "wide-overlaps"])
def test_the_units_blend_into_diffusers_decode_bit_for_bit(decoders, shape):
    latent = torch.randn(24, *shape, generator=torch.Generator().manual_seed(sum(shape)))
    model = decoders.video.model
    with torch.inference_mode():
        z = denormalized_video(decoders.video, latent)
        tiles = VideoTiles.of(model, *z.shape[2:])
        ours = to_pixels(tiles.assemble(lambda k: tiles.unit(model, z, k), like=z))
    assert torch.equal(ours, decode_video(decoders.video, latent))


def test_units_out_of_order_are_not_the_decode(decoders):
    """The check can fail: two units of a window swapped give another clip."""
    latent = torch.randn(24, 7, 18, 22, generator=torch.Generator().manual_seed(1))
    model = decoders.video.model
    with torch.inference_mode():
        z = denormalized_video(decoders.video, latent)
        tiles = VideoTiles.of(model, *z.shape[2:])
        units = [tiles.unit(model, z, k) for k in range(tiles.count)]
        swapped = tiles.assemble(lambda k: units[{1: 2, 2: 1}.get(k, k)], like=z)
        right = tiles.assemble(lambda k: units[k], like=z)
    assert tiles.count == 4 and not torch.equal(swapped, right)


def test_a_clip_the_geometry_refuses_is_a_value_error(decoders):
    with pytest.raises(ValueError, match="5n\\+2"):
        VideoTiles.of(decoders.video.model, 8, 8, 8)


@pytest.mark.parametrize(("units", "ranks"), [(1, 3), (8, 3), (30, 2), (7, 7)])
def test_units_are_shared_in_contiguous_even_runs(units, ranks):
    runs = shares(units, ranks)
    assert [k for run in runs for k in run] == list(range(units))
    assert max(map(len, runs)) - min(map(len, runs)) <= 1 and len(runs[0]) >= len(runs[-1])
    assert owners(units, ranks) == [r for r, run in enumerate(runs) for _ in run]


def test_the_estimate_counts_each_ranks_share():
    one, two = estimate_decode_memory(864, 480, 39, ranks=1), estimate_decode_memory(864, 480, 39, ranks=2)
    assert (one.windows, one.tiles_per_window) == (2, 15) and len(two.rank_bytes) == 2
    assert two.rank_bytes[1] < two.rank_bytes[0]  # rank 0 holds the clip; rank 1 its 15 units
    assert two.rank_bytes[1] >= two.weights_bytes + 15 * two.unit_bytes
