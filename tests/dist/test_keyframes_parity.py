"""FL2VA on every count, both modes: a first + last keyframe request (condition rows after the text,
vision blocks tagged 0 inside it) on 1, 2, 4, 6 and 8 Gloo ranks of the shared World gives the
one-rank latents within today's derived bound (Ulysses and tensor mode at one rank: bitwise). The
keyframes and prompt are encoded once here (rank 0's job in a run) and handed to every count, so the
check is the distribution of the packed sequence alone; a rank that feeds the wrong condition rows
(shifted by one) is caught."""

from __future__ import annotations

import pytest
import torch

from mutations import shifted_condition_rows
from h3core.generate.parity import latent_parity, tolerance
from h3core.generate.pipeline import RankPipeline, encode_request, finish_record, keyframe_latents, new_record, open_text_encoder, prepared_images, rank_runtime
from h3core.generate.request import GenerateRequest, resolve
from h3core.model.sequence import SegmentKind
from h3core.parallel.modes import Mode
from h3core.verify.session import as_world_of_one

COUNTS = (2, 4, 6, 8)


@pytest.fixture(scope="module")
def keyframes(tmp_path_factory):
    from PIL import Image

    folder = tmp_path_factory.mktemp("keyframes")
    generator = torch.Generator().manual_seed(4)
    paths = {}
    for role, size in (("first", (400, 300)), ("last", (300, 300))):
        pixels = torch.randint(0, 256, (size[1], size[0], 3), generator=generator, dtype=torch.uint8).numpy()
        Image.fromarray(pixels, "RGB").save(folder / f"{role}.png")
        paths[role] = folder / f"{role}.png"
    return paths


def _run(keyframes, mode: Mode, count: int):
    request = GenerateRequest(preset="tiny", mode=mode, world_size=count, steps=3, device="cpu", keyframes=keyframes, prompt="a fox turns its head")
    return resolve(request)


@pytest.fixture(scope="module")
def given(keyframes):
    """What rank 0 broadcasts in a run, made once: the states of the prompt presented after both keyframes, their latents."""
    run = _run(keyframes, Mode.ULYSSES, 1)
    (latents,) = keyframe_latents([run], torch.device("cpu"))
    encoder = open_text_encoder(run, torch.device("cpu"))
    conditioning = encode_request(encoder, run, prepared_images(run))
    conditioning.keyframes = latents
    return conditioning


def _denoise(ctx, count, run, given, broken=False):  # type: ignore[no-untyped-def]
    """World task: load and denoise `run` on ranks 0..count-1 with the given conditioning; rank 0's latents."""
    sub = ctx.first_ranks(count) if count > 1 else (as_world_of_one(ctx) if ctx.rank == 0 else None)
    if sub is None:
        return None
    pipeline = RankPipeline.load(sub, run, rank_runtime(sub, run))
    record = new_record(sub)
    with shifted_condition_rows(broken):
        whole = pipeline.denoise(run, given, record)
    outcome = finish_record(record, run, pipeline, whole, given.keyframes)
    return outcome.latents if sub.rank == 0 else None


def test_keyframe_rows_are_ordinary_rows_for_both_modes_at_every_count(world8, keyframes, given):
    one = world8.run(_denoise, 1, _run(keyframes, Mode.ULYSSES, 1), given)[0]
    assert one["condition_video"].shape == (24, 2, 8, 10) and torch.equal(one["condition_video"], given.keyframes)
    for mode in Mode:
        at_one = world8.run(_denoise, 1, _run(keyframes, mode, 1), given)[0]
        assert latent_parity(at_one, one, 0.0, "1 rank").bitwise  # both modes at one rank: the identity path
        for count in COUNTS:
            run = _run(keyframes, mode, count)
            assert [s.kind for s in run.plan.segments].count(SegmentKind.CONDITION) == 1
            latents = world8.run(_denoise, count, run, given)[0]
            parity = latent_parity(latents, one, tolerance(mode, torch.float32), "1 rank")
            print(f"fl2va first+last, {mode.value} x{count}: relative {parity.relative:.3g} (bound {parity.tolerance:.3g}){' bitwise' if parity.bitwise else ''}")
            assert parity.passed, parity


def test_a_rank_feeding_shifted_condition_rows_breaks_parity(world8, keyframes, given):
    one = world8.run(_denoise, 1, _run(keyframes, Mode.ULYSSES, 1), given)[0]
    broken = world8.run(_denoise, 4, _run(keyframes, Mode.ULYSSES, 4), given, True)[0]
    parity = latent_parity(broken, one, tolerance(Mode.ULYSSES, torch.float32), "1 rank")
    print(f"condition rows one row off on the ranks holding them, ulysses x4: relative {parity.relative:.3g} (bound {parity.tolerance:.3g})")
    assert not parity.passed
