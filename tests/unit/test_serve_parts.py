"""`h3 serve`'s pieces without a server: the one mapping API request -> GenerateRequest, the keyframe
and path checks, and the SQLite queue's life of a job (crash recovery included)."""

from __future__ import annotations

import io
from pathlib import Path
import os

import pytest
from PIL import Image

from h3core.generate.request import GenerateRequest
from h3core.serve.api import JOB_ID, ApiError, VideoCreate
from h3core.serve.inputs import MAX_IMAGE_PIXELS, JobInputs, Limits, allowed_file, check_image, save_keyframe
from h3core.serve.queue import MAX_ATTEMPTS, JobQueue
from h3core.serve.request import to_generate_request

TEMPLATE = GenerateRequest(preset="tiny", steps=3, seed=1)


def _map(inputs: JobInputs | None = None, **fields) -> GenerateRequest:
    return to_generate_request(VideoCreate(**{"prompt": "a fox", **fields}), TEMPLATE, inputs or JobInputs(), "h3")


def _code(call) -> tuple[int, str]:
    with pytest.raises(ApiError) as caught:
        call()
    return caught.value.status, caught.value.code


def test_the_mapping_takes_openais_fields_and_h3s():
    req = _map(seconds="2", size="128x64", seed=9, steps=5, guidance=1.0, negative_prompt="blur")
    assert (req.frames, req.width, req.height, req.seed, req.steps, req.negative_prompt) == (48, 128, 64, 9, 5, "blur")
    assert _map(frames=39).frames == 39 and _map().seed == 1 and _map().prompt == "a fox"
    assert _map(model="h3").prompt == "a fox"


@pytest.mark.parametrize("fields, code", [
    ({"seconds": "2", "frames": 22}, "invalid_request"), ({"seconds": "soon"}, "invalid_request"), ({"seconds": "-1"}, "invalid_request"),
    ({"model": "sora-2"}, "model_not_found"), ({"steps": 1}, None),
])
def test_the_mapping_refuses_what_cannot_run_in_one_line(fields, code):
    if code is None:  # a field out of range is the model's own 400 (pydantic)
        with pytest.raises(ValueError):
            VideoCreate(prompt="a fox", **fields)
        return
    assert _code(lambda: _map(**fields)) == (400, code)


def test_keyframes_and_adapters_map_onto_the_request(tmp_path):
    from h3core.lora.spec import LoraSpec

    request = _map(JobInputs(keyframes={"first": str(tmp_path / "first.png")}, loras=[("/srv/style.safetensors", 0.5)]))
    assert request.keyframes == {"first": tmp_path / "first.png"}
    assert request.loras == (LoraSpec(path=Path("/srv/style.safetensors"), scale=0.5),)


def _png(width: int, height: int, mode: str = "RGB") -> bytes:
    out = io.BytesIO()
    Image.new(mode, (width, height)).save(out, format="PNG")
    return out.getvalue()


def test_images_are_checked_by_kind_and_pixels_before_they_are_decoded(tmp_path):
    assert check_image(_png(8, 8), "input_reference") == "png"
    side = int(MAX_IMAGE_PIXELS**0.5) + 1
    assert _code(lambda: check_image(_png(side, side, "1"), "input_reference")) == (400, "image_too_large")
    assert _code(lambda: check_image(b"GIF89a not really", "input_reference")) == (400, "invalid_image")
    assert _code(lambda: save_keyframe(tmp_path, "first", _png(8, 8), "x", Limits(image_bytes=10))) == (413, "image_too_large")
    saved = save_keyframe(tmp_path / "in", "first", _png(8, 8), "x", Limits())
    assert saved == str(tmp_path / "in" / "first.png") and os.path.getsize(saved) > 0


def test_server_local_paths_only_under_an_allowed_directory(tmp_path):
    allowed, other = tmp_path / "allowed", tmp_path / "other"
    allowed.mkdir(), other.mkdir()
    (allowed / "a.png").write_bytes(_png(4, 4))
    (other / "secret.png").write_bytes(_png(4, 4))
    (allowed / "escape.png").symlink_to(other / "secret.png")
    roots = [allowed.resolve()]
    assert allowed_file(str(allowed / "a.png"), roots, "k", 1 << 20) == (allowed / "a.png").resolve()
    for refused in (str(other / "secret.png"), str(allowed / "escape.png"), str(allowed / ".." / "other" / "secret.png"), "a.png",
                    str(allowed), str(allowed / "missing.png")):
        assert _code(lambda: allowed_file(refused, roots, "k", 1 << 20)) == (400, "path_not_allowed"), refused
    assert _code(lambda: allowed_file(str(allowed / "a.png"), [], "k", 1 << 20)) == (400, "paths_not_allowed")


def test_ids_are_the_only_thing_looked_up():
    assert JOB_ID.match("video_" + "0" * 32)
    for bad in ("video_../../etc", "../video_" + "0" * 32, "video_" + "0" * 31, "video_" + "A" * 32, "video_" + "0" * 32 + "/x"):
        assert not JOB_ID.match(bad)


def _row(n: int) -> dict:
    return {"id": f"video_{n:032x}", "created_at": float(n), "request": VideoCreate(prompt=f"p{n}").model_dump_json(), "inputs": "{}",
            "model": "h3", "size": "64x64", "seconds": "1", "steps": 3, "frames": 22, "seed": n}


def test_the_queue_keeps_every_job_across_a_crash(tmp_path):
    queue = JobQueue(tmp_path)
    for n in range(4):
        assert queue.add(_row(n), max_queued=3) is (n < 3)  # the cap: 429
    done, running = queue.claim(2)
    assert [done["id"], running["id"]] == [_row(0)["id"], _row(1)["id"]] and queue.counts()["in_progress"] == 2
    (tmp_path / "jobs" / done["id"]).mkdir(parents=True)
    (tmp_path / "jobs" / done["id"] / "video.mp4").write_bytes(b"mp4")
    assert queue.finish(done["id"], "completed", progress=100)
    assert queue.delete(_row(2)["id"])["status"] == "queued" and queue.get(_row(2)["id"]) is None
    queue.close()  # as a kill -9 leaves it: one job in progress

    again = JobQueue(tmp_path)
    found = again.recover(lambda job_id: tmp_path / "jobs" / job_id)
    assert found.requeued == [running["id"]] and found.completed == 1 and found.deleted == [_row(2)["id"]]
    assert again.get(running["id"])["status"] == "queued" and again.get(done["id"])["status"] == "completed"
    rows, more = again.page(limit=1, after=None, newest_first=True)
    assert [r["id"] for r in rows] == [running["id"]] and more
    for _ in range(MAX_ATTEMPTS - 1):  # interrupted every time it runs: it fails instead of looping
        (job,) = again.claim(1)
        again.recover(lambda job_id: tmp_path / "jobs" / job_id)
    assert again.get(running["id"])["status"] == "failed" and again.get(running["id"])["error_code"] == "interrupted"
    assert not again.finish(_row(2)["id"], "completed")  # a deleted job is never completed


def test_the_bench_counts_jobs_that_ran_at_once():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
    try:
        import bench_serve
    finally:
        sys.path.pop(0)
    rows = [{"claimed_at": 0, "completed_at": 5}, {"claimed_at": 1, "completed_at": 4}, {"claimed_at": 6, "completed_at": 7}]
    assert bench_serve.most_at_once(rows) == 2 and bench_serve.most_at_once(rows[:1] + rows[2:]) == 1
