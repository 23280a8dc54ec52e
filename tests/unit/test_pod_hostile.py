"""A misbehaving RunPod API on 127.0.0.1: every answer other than a clear refusal to a create says the
pod may exist; transport failures are one line; a whole request has a deadline; no fragment of the
key is ever shown."""

from __future__ import annotations

import _thread
import threading
import time
import tracemalloc
import zlib

import pytest
from runpod_fake import SERVER_EDITION, TEST_KEY, problem

from h3core.errors import Interrupted, RemoteAPIError
from h3core.pod import Cloud, RetryPolicy, RunPodClient
from h3core.pod.client import redact
from h3core.pod.deadline import MAX_ANSWER_BYTES
from h3core.pod.models import CreateGpu, CreatePodRequest, Mounts, PersistentMount

ONCE = RetryPolicy(attempts=1, backoff_s=0)
TWICE = RetryPolicy(attempts=2, backoff_s=0)
MAY_EXIST = "the pod may exist and cost money: check `h3 pod list` before trying again"


def _client(runpod, retry=TWICE, timeout=2.0) -> RunPodClient:
    return RunPodClient(TEST_KEY, runpod.base_url, retry=retry, sleep=lambda s: None, read_timeout_s=timeout, write_timeout_s=timeout)


def _request() -> CreatePodRequest:
    return CreatePodRequest(
        name="h3-test", image="runpod/pytorch:1.0.3-cu1300-torch291-ubuntu2404",
        gpu=CreateGpu(id=SERVER_EDITION, count=8, min_cuda_version="13.0"), cloud=Cloud.SECURE,
        data_center_ids=["EUR-IS-1"], disk=50, ports=["22/tcp"], env={},
        mounts=Mounts(persistent=PersistentMount(size=100, path="/workspace")), start_ssh=True,
    )


def _fragments(text: str, secret: str = TEST_KEY, n: int = 6) -> list[str]:
    return [secret[i : i + n] for i in range(len(secret) - n + 1) if secret[i : i + n] in text]


def _line(err: pytest.ExceptionInfo) -> str:
    text = str(err.value)
    assert "\n" not in text and not _fragments(text), text
    return text


CHUNKED_CUT = b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n5\r\n{\"pod\r\nZZ\r\n"
GZIP_GARBAGE = b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Encoding: gzip\r\nContent-Length: 12\r\n\r\nnot gzip at!"
REDIRECT_LOOP = b"HTTP/1.1 302 Found\r\nConnection: close\r\nLocation: /v2/pods\r\nContent-Length: 0\r\n\r\n"


# --- transport failures: one line, reads retried where it makes sense ------------------------------


@pytest.mark.parametrize(
    "raw, reason, tries",
    [
        (CHUNKED_CUT, "the answer was cut off (a broken chunked body)", 2),
        (GZIP_GARBAGE, "the answer's compressed body is corrupt", 2),
        (REDIRECT_LOOP, "more than 5 redirects (a redirect loop?)", 1),
    ],
)
def test_transport_failures_on_a_read_are_one_line(runpod, raw, reason, tries):
    runpod.script("GET", "/v2/pods", raw=raw, times=100)
    with pytest.raises(RemoteAPIError) as err:
        _client(runpod).list_pods()
    assert reason in _line(err)
    assert len(runpod.sent("GET")) == (tries if tries == 2 else 6)  # a loop is 1 + 5 redirects, never retried


def test_a_read_trickling_one_byte_at_a_time_ends_at_the_deadline(runpod):
    # Each byte comes well within the 1 s per-read timeout; only a whole-request deadline ends it.
    runpod.script("GET", "/v2/pods", 200, {"pods": []}, trickle_s=0.2, times=5)
    start = time.monotonic()
    with pytest.raises(RemoteAPIError) as err:
        _client(runpod, retry=ONCE, timeout=1.0).list_pods()
    assert time.monotonic() - start < 3
    assert "no complete answer within 1 s" in _line(err)


# --- a create: only a clear refusal says nothing happened ------------------------------------------


@pytest.mark.parametrize(
    "script, reason",
    [
        (dict(raw=b"HTTP/1.1 201 Created\r\nConnection: close\r\nContent-Type: text/html\r\nContent-Length: 9\r\n\r\n<html>ok!"), "HTTP 201 with an answer h3 cannot read"),
        (dict(status=201, body={"name": "h3-test", "status": "PROVISIONING"}), "HTTP 201 with an answer h3 cannot read (unexpected answer (id: Field required)"),
        (dict(status=200, body={"message": "queued"}), "HTTP 200 with an answer h3 cannot read"),
        (dict(raw=b"HTTP/1.1 307 Temporary Redirect\r\nConnection: close\r\nLocation: /v2/pods\r\nContent-Length: 0\r\n\r\n"), "HTTP 307"),
        (dict(status=502), "HTTP 502"),
        (dict(raw=CHUNKED_CUT.replace(b"200 OK", b"201 Created")), "the answer was cut off"),
        (dict(raw=GZIP_GARBAGE.replace(b"200 OK", b"201 Created")), "compressed body is corrupt"),
    ],
)
def test_a_create_answered_other_than_by_a_refusal_may_have_made_a_pod(runpod, script, reason):
    runpod.script("POST", "/v2/pods", **script)
    with pytest.raises(RemoteAPIError) as err:
        _client(runpod).create_pod(_request())
    text = _line(err)
    assert reason in text and MAY_EXIST in text, text
    assert len(runpod.sent("POST")) == 1  # never repeated
    runpod.contract_violations.clear()  # the fake was told to break the contract


def test_a_create_refused_with_a_4xx_says_nothing_was_created(runpod):
    runpod.script("POST", "/v2/pods", 403, problem(403, "Forbidden", "no pod:write"))
    with pytest.raises(RemoteAPIError) as err:
        _client(runpod).create_pod(_request())
    text = _line(err)
    assert "HTTP 403" in text and "nothing was created" in text and "may exist" not in text


def test_a_create_answered_200_with_a_pod_returns_the_pod(runpod):
    pod = _client(runpod).create_pod(_request())
    assert pod.id in runpod.pods and len(runpod.sent("POST")) == 1


def test_a_create_trickling_its_answer_ends_at_the_deadline_and_may_exist(runpod):
    runpod.script("POST", "/v2/pods", 201, {"id": "pod0000009"}, trickle_s=0.2)
    with pytest.raises(RemoteAPIError) as err:
        _client(runpod, timeout=1.0).create_pod(_request())
    text = _line(err)
    assert "no complete answer within 1 s" in text and MAY_EXIST in text


def test_ctrl_c_during_a_create_says_the_pod_may_exist(runpod):
    runpod.script("POST", "/v2/pods", 201, {"id": "pod0000009"}, trickle_s=0.1)
    threading.Timer(0.5, _thread.interrupt_main).start()
    with pytest.raises(Interrupted) as err:
        _client(runpod, timeout=30).create_pod(_request())
    assert "interrupted (Ctrl-C) while RunPod create pod was in flight" in str(err.value) and MAY_EXIST in str(err.value)
    assert err.value.exit_code == 130


def test_a_terminate_answered_by_a_5xx_may_have_happened(runpod):
    pod = runpod.add_pod()
    runpod.script("DELETE", f"/v2/pods/{pod['id']}", 504)
    with pytest.raises(RemoteAPIError) as err:
        _client(runpod).terminate_pod(pod["id"])
    assert f"may or may not have been applied: check `h3 pod get {pod['id']}`" in _line(err)


# --- the key: redacted before any cut, never a fragment ----------------------------------------------


@pytest.mark.parametrize("at", [0, 380, 390, 395, 398, 420])
def test_a_key_echoed_anywhere_in_an_error_body_never_shows_in_part(runpod, at):
    detail = "x" * at + f"Authorization: Bearer {TEST_KEY} " + "y" * 200
    runpod.script("GET", "/v2/pods", 403, problem(403, "Forbidden", detail))
    with pytest.raises(RemoteAPIError) as err:
        _client(runpod).list_pods()
    assert "HTTP 403 Forbidden" in _line(err)


def test_a_partial_echo_of_the_key_is_redacted_too():
    partial = TEST_KEY[:14]
    assert _fragments(redact(f"token {partial}... rejected", TEST_KEY)) == []
    assert redact(f"token {TEST_KEY} rejected", TEST_KEY) == "token <redacted> rejected"
    assert redact("no secret here: connection refused", TEST_KEY) == "no secret here: connection refused"


# --- bounded answers: a deadline for the whole answer and a size cap, whatever the HTTP version ------

HEAD_10 = b"HTTP/1.0 200 OK\r\nContent-Type: application/json\r\n\r\n"  # HTTP/1.0: the body runs until the server closes
HEAD_CLOSE = b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Type: application/json\r\n\r\n"  # no length, no chunks: until close
HEAD_LENGTH = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 99999999999\r\n\r\n"
HEAD_CHUNKED = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
HEADS = {"HTTP/1.0": HEAD_10, "Connection: close": HEAD_CLOSE, "Content-Length": HEAD_LENGTH}


@pytest.mark.parametrize("head", list(HEADS.values()), ids=list(HEADS))
def test_a_body_trickling_after_its_head_ends_at_the_deadline(runpod, head):
    # The head arrives at once (http.client hands the socket to the response on HTTP/1.0 and
    # Connection: close); then one byte every 0.2 s, each well within the per-read timeout.
    runpod.script("GET", "/v2/pods", raw=head + b'{"pods": []}' + b" " * 200, trickle_s=0.2, trickle_from=len(head))
    start = time.monotonic()
    with pytest.raises(RemoteAPIError) as err:
        _client(runpod, retry=ONCE, timeout=1.0).list_pods()
    assert time.monotonic() - start < 2.5
    assert "no complete answer within 1 s" in _line(err)


def test_a_create_whose_answer_body_trickles_ends_at_the_deadline_and_may_exist(runpod):
    body = b'{"id": "pod0000009"}' + b" " * 200
    runpod.script("POST", "/v2/pods", raw=HEAD_10.replace(b"200 OK", b"201 Created") + body, trickle_s=0.2, trickle_from=len(HEAD_10) + 4)
    start = time.monotonic()
    with pytest.raises(RemoteAPIError) as err:
        _client(runpod, timeout=1.0).create_pod(_request())
    assert time.monotonic() - start < 2.5
    text = _line(err)
    assert "no complete answer within 1 s" in text and MAY_EXIST in text


def _zeros_forever(head: bytes):
    def chunks():
        yield head
        while True:
            yield b"0" * 65536
    return chunks


def _chunked_forever():
    yield HEAD_CHUNKED
    while True:
        yield b"10000\r\n" + b"0" * 65536 + b"\r\n"


def _gzip_bomb(encoding: str):
    """An endless compressed body: 1 MiB of spaces per kB sent (gzip: member after member; deflate: one endless stream)."""
    head = HEAD_10.replace(b"\r\n\r\n", f"\r\nContent-Encoding: {encoding}\r\n\r\n".encode())
    packer = zlib.compressobj(9, zlib.DEFLATED, 31)
    member = packer.compress(b" " * (1 << 20)) + packer.flush()

    def chunks():
        yield head
        if encoding == "gzip":
            while True:
                yield member
        stream = zlib.compressobj(9, zlib.DEFLATED, 15)
        while True:
            yield stream.compress(b" " * (1 << 20)) + stream.flush(zlib.Z_SYNC_FLUSH)
    return chunks


@pytest.mark.parametrize("stream", [
    _zeros_forever(HEAD_10), _zeros_forever(HEAD_CLOSE), _zeros_forever(HEAD_LENGTH), _chunked_forever, _gzip_bomb("gzip"), _gzip_bomb("deflate"),
], ids=["HTTP/1.0", "Connection: close", "Content-Length", "chunked", "gzip bomb", "deflate bomb"])
def test_an_endless_or_inflating_body_stops_at_the_cap_in_bounded_memory(runpod, stream):
    runpod.script("GET", "/v2/pods", raw=stream, times=5)
    tracemalloc.start()
    try:
        with pytest.raises(RemoteAPIError) as err:
            _client(runpod, retry=TWICE, timeout=20).list_pods()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert f"the answer is larger than {MAX_ANSWER_BYTES >> 20} MiB" in _line(err)
    assert peak < 4 * MAX_ANSWER_BYTES, peak  # the cap and what is read around it, not the body
    assert len(runpod.sent("GET")) == 1  # a body that large is not RunPod: not retried


def test_a_create_answered_by_an_endless_body_may_exist(runpod):
    runpod.script("POST", "/v2/pods", raw=_zeros_forever(HEAD_10.replace(b"200 OK", b"201 Created")))
    with pytest.raises(RemoteAPIError) as err:
        _client(runpod, timeout=20).create_pod(_request())
    text = _line(err)
    assert "larger than" in text and MAY_EXIST in text


RETRY_AFTERS = ["²", "³¹", "12s", "-1", "1e3", " ", "Mon, 99 Foo 2026", "99999999999999999999999"]


@pytest.mark.parametrize("value", RETRY_AFTERS)
def test_a_read_told_to_retry_after_anything_is_one_line(runpod, value):
    runpod.script("GET", "/v2/pods", 429, problem(429, "Too Many Requests", "slow down"), headers={"Retry-After": value}, times=2)
    with pytest.raises(RemoteAPIError) as err:
        _client(runpod).list_pods()
    assert "HTTP 429" in _line(err) or "rate limited" in _line(err)


@pytest.mark.parametrize("value", RETRY_AFTERS)
def test_a_create_refused_with_any_retry_after_says_nothing_was_created(runpod, value):
    runpod.script("POST", "/v2/pods", 429, problem(429, "Too Many Requests", "slow down"), headers={"Retry-After": value})
    with pytest.raises(RemoteAPIError) as err:
        _client(runpod).create_pod(_request())
    assert "nothing was created; rate limited" in _line(err)


@pytest.mark.parametrize("status", [201, 429, 503])
def test_any_failure_reading_the_answer_to_a_create_says_the_pod_may_exist(runpod, monkeypatch, status):
    # Whatever goes wrong after the POST was sent (here: a bug in reading the answer), the line says so.
    def broken(*args, **kwargs):
        raise ValueError("a bug")

    monkeypatch.setattr(RunPodClient, "_json", broken)
    monkeypatch.setattr(RunPodClient, "_create_hint", broken)
    monkeypatch.setattr(RunPodClient, "_problem_text", broken)
    runpod.script("POST", "/v2/pods", status, {"id": "pod0000009"} if status == 201 else None)
    with pytest.raises(RemoteAPIError) as err:
        _client(runpod).create_pod(_request())
    text = _line(err)
    assert "an answer h3 failed to interpret (ValueError)" in text and MAY_EXIST in text
    runpod.contract_violations.clear()


def test_a_redirect_with_an_endless_body_stops_at_the_cap(runpod):
    head = b"HTTP/1.0 302 Found\r\nLocation: /v2/pods\r\n\r\n"
    runpod.script("GET", "/v2/pods", raw=_zeros_forever(head), times=5)
    with pytest.raises(RemoteAPIError) as err:
        _client(runpod, retry=ONCE, timeout=20).list_pods()
    assert "larger than" in _line(err)


def test_sigterm_during_a_create_says_the_pod_may_exist_and_exits_143(runpod):
    import os
    import signal

    from h3core.errors import Terminated

    def terminated(*_):
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, terminated)  # what `h3`'s main installs
    try:
        runpod.script("POST", "/v2/pods", 201, {"id": "pod0000009"}, trickle_s=0.1)
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM)).start()
        with pytest.raises(Interrupted) as err:
            _client(runpod, timeout=30).create_pod(_request())
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert "interrupted (SIGTERM) while RunPod create pod was in flight" in str(err.value) and MAY_EXIST in str(err.value)
    assert err.value.exit_code == 143


# --- answers h3 cannot parse: deep JSON, endless numbers (read as h3 reads any JSON) ------------------------


def _json_answer(body: bytes, status: bytes = b"200 OK") -> bytes:
    return b"HTTP/1.1 " + status + b"\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body


@pytest.mark.parametrize("body, reason", [
    (b"[" * 100_000 + b"]" * 100_000, "JSON nested deeper than 100 levels"),
    (b'{"pods": ' + b"9" * 5000 + b"}", "a number of 5000 characters"),
    (b"\xff\xfe", "not UTF-8 text"),
])
def test_an_answer_h3_cannot_parse_is_one_line(runpod, body, reason):
    runpod.script("GET", "/v2/pods", raw=_json_answer(body), times=5)
    with pytest.raises(RemoteAPIError) as err:
        _client(runpod, retry=ONCE).list_pods()
    assert reason in _line(err) and "RunPod's API?" in str(err.value)


def test_a_deep_error_body_still_gives_the_status_line(runpod):
    runpod.script("GET", "/v2/pods", raw=_json_answer(b"[" * 100_000 + b"]" * 100_000, b"404 Not Found"), times=5)
    with pytest.raises(RemoteAPIError) as err:
        _client(runpod, retry=ONCE).list_pods()
    assert "HTTP 404" in _line(err)
