"""`h3 serve` driven by the official `openai` client, unchanged (`base_url=http://127.0.0.1:PORT/v1`):
create, poll to completion, download (the mp4 probes as H.264 + AAC), list, delete, and a running job
cancelled at a step boundary. `pytest -s` prints the transcript."""

from __future__ import annotations

import time

import pytest

from commands import SERVE_KEY, http

openai = pytest.importorskip("openai", reason="the openai client is a test extra: pip install -e '.[test]'")
pytestmark = pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")  # the client's own notice


def _client(server) -> "openai.OpenAI":
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=SERVE_KEY, max_retries=0, timeout=60)


def _until(check, seconds: float, what: str):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.25)
    raise AssertionError(f"{what} within {seconds}s")


def test_the_openai_client_creates_polls_downloads_lists_and_deletes(served, tmp_path):
    import av

    client, transcript = _client(served), []
    job = client.videos.create(prompt="a red fox running through fresh snow", seconds="1", size="64x64")
    transcript.append(f"create -> {job.id} status={job.status} size={job.size} seconds={job.seconds} model={job.model}")
    assert job.object == "video" and job.status == "queued" and job.size == "64x64" and job.progress == 0

    def done():
        current = client.videos.retrieve(job.id)
        if current.status not in ("queued", "in_progress"):
            return current
        transcript.append(f"retrieve -> {current.status} {current.progress}%") if not transcript[-1].endswith(f"{current.status} {current.progress}%") else None
        return None

    finished = _until(done, 600, "the job did not finish")
    transcript.append(f"retrieve -> {finished.status} {finished.progress}%")
    assert finished.status == "completed" and finished.progress == 100 and finished.error is None and finished.completed_at

    path = tmp_path / "fox.mp4"
    client.videos.download_content(job.id).write_to_file(path)
    with av.open(str(path)) as container:
        codecs = sorted(s.codec_context.name for s in container.streams)
        video = container.streams.video[0]
        transcript.append(f"download_content -> {path.stat().st_size} bytes: {codecs}, {video.codec_context.width}x{video.codec_context.height}")
    assert codecs == ["aac", "h264"] and (video.codec_context.width, video.codec_context.height) == (64, 64)
    thumbnail = client.videos.download_content(job.id, variant="thumbnail").read()
    assert thumbnail.startswith(b"\x89PNG")

    listed = client.videos.list(limit=5)
    transcript.append(f"list -> {[v.id for v in listed.data]}")
    assert listed.data[0].id == job.id

    deleted = client.videos.delete(job.id)
    transcript.append(f"delete -> {deleted.id} deleted={deleted.deleted}")
    assert deleted.deleted and deleted.object == "video.deleted"
    with pytest.raises(openai.NotFoundError):
        client.videos.retrieve(job.id)
    assert not (served.state / "jobs" / job.id).exists()
    print("\n" + "\n".join(transcript))


def test_a_running_job_deleted_through_the_client_stops_at_its_next_step(served):
    """5000 steps would take minutes: the group is free again within seconds, and takes the next job."""
    client = _client(served)
    for n in range(2):
        job = client.videos.create(prompt=f"a very long clip {n}", size="64x64", extra_body={"steps": 5000})
        _until(lambda: client.videos.retrieve(job.id).status == "in_progress", 120, "the long job did not start")
        time.sleep(1.0)  # some steps run
        started = time.monotonic()
        assert client.videos.delete(job.id).deleted
        _until(lambda: http("GET", f"{served.url}/health")[1]["running"] == 0, 30, "the cancelled job's group was not freed")
        print(f"\ncancel -> the group was free {time.monotonic() - started:.2f}s after delete")
        with pytest.raises(openai.NotFoundError):
            client.videos.retrieve(job.id)
        assert not (served.state / "jobs" / job.id).exists() and not list((served.state / "jobs").glob(f".{job.id}*staging*"))


def test_a_wrong_key_is_the_clients_authentication_error(served):
    bad = openai.OpenAI(base_url=f"{served.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.videos.list()
