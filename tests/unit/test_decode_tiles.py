"""`VideoTiles`: the tiled decode as units and their blend, bit for bit diffusers' `decode` (one
process; the ranks' version is tests/dist/test_decode_spread.py), and how units are shared out."""

from __future__ import annotations

import pytest
import torch

from h3core.decode.memory import estimate_decode_memory
from h3core.decode.clip import decode_video, denormalized_video, to_pixels
from h3core.decode.run import Decoders
from h3core.decode.spread import Balance, SpreadStats
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


@pytest.mark.parametrize(("units", "ranks", "shift", "sizes"), [(30, 2, 1, [16, 14]), (8, 3, 1, [4, 3, 1]), (8, 3, 5, [5, 3, 0]), (5, 1, 3, [5]), (30, 2, -2, [15, 15])])
def test_a_shift_moves_the_last_ranks_units_to_rank_0(units, ranks, shift, sizes):
    runs = shares(units, ranks, shift)
    assert [len(run) for run in runs] == sizes  # clamped to what the last rank has; none at one rank or below 0
    assert [k for run in runs for k in run] == list(range(units))
    assert owners(units, ranks, shift) == [r for r, run in enumerate(runs) for _ in run]


def _stats(shift: int, assembled: float, last_units_s: float, audio: float, last_units: int = 14) -> SpreadStats:
    return SpreadStats(rank=0, ranks=2, units=30 - last_units, shift=shift, assembled_s=assembled, last_units_s=last_units_s, audio_s=audio, last_units=last_units)


def test_the_balance_moves_half_the_gap_in_the_last_ranks_units():
    balance, key = Balance(), (2, 24, 12, 30, 54, 2, 32, 65)
    assert balance.shift(key) == 0  # the first decode of a size: even shares
    balance.learn(key, _stats(0, assembled=2.10, last_units_s=1.85, audio=0.45, last_units=15))  # rank 0 waited 0.2 s; a unit is 0.123 s
    assert balance.shift(key) == 1 and balance.estimates[key] == pytest.approx(0.2 / (2 * 1.85 / 15))
    balance.learn(key, _stats(1, assembled=2.22, last_units_s=1.72, audio=0.45))  # even enough: stays
    assert balance.shift(key) == 1
    balance.learn(key, _stats(1, assembled=2.30, last_units_s=1.72, audio=0.45))  # one clock late by about a unit does not swing it back
    assert balance.shift(key) == 1
    balance.learn(key, _stats(1, assembled=2.80, last_units_s=1.40, audio=0.40))  # rank 0 is now the one late, again: back
    assert balance.shift(key) == 0
    balance.learn(key, _stats(0, assembled=3.0, last_units_s=1.0, audio=0.1, last_units=15))  # never below even
    assert balance.shift(key) == 0 and balance.shift((3, *key[1:])) == 0  # per size and rank count
    balance.learn(key, _stats(0, assembled=2.0, last_units_s=2.1, audio=0.9, last_units=15))  # 3.6 units late: halfway there at once
    assert balance.shift(key) == 2
    one = SpreadStats(rank=0, ranks=1, units=30, audio_s=0.4, assembled_s=3.7)
    balance.learn((1, *key[1:]), one)
    assert (1, *key[1:]) not in balance.estimates  # one rank has no one to balance against


def test_the_estimate_counts_each_ranks_share():
    one, two = estimate_decode_memory(864, 480, 39, ranks=1), estimate_decode_memory(864, 480, 39, ranks=2)
    assert (one.windows, one.tiles_per_window) == (2, 15) and len(two.rank_bytes) == 2
    assert two.rank_bytes[1] < two.rank_bytes[0]  # rank 0 holds the clip; rank 1 its 15 units
    assert two.rank_bytes[1] >= two.weights_bytes + 15 * two.unit_bytes
