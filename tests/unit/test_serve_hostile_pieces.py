"""The server's own defences, in process (issue 36, the new surfaces): slow clients (uvicorn as
`h3 serve` configures it, `HeadDeadline` and the `Guard`'s body deadline, at sub-second limits), an
allowed server-local file that a swapped link would lead out of, and a state directory whose SQLite
file is damaged: one line naming it, the file left as it was, never reset."""

from __future__ import annotations

import os
import socket
import sqlite3
import struct
import threading
import time
import warnings
import zlib
from pathlib import Path

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse

from h3core.errors import ConfigError
from h3core.serve.api import ApiError
from h3core.serve.app import Guard
from h3core.serve.inputs import Limits, allowed_file, read_allowed
from h3core.serve.queue import JobQueue
from h3core.serve.server import HEADER_BYTES, uvicorn_config

LIMITS = Limits(head_seconds=0.6, body_seconds=0.6)


def _echo_app():
    """A FastAPI app with h3's error handlers whose one route reads the whole body and answers its length."""
    from h3core.serve.app import _errors

    app = FastAPI()
    _errors(app)

    @app.api_route("/", methods=["GET", "POST"])
    async def echo(request: Request) -> PlainTextResponse:
        return PlainTextResponse(str(len(await request.body())))

    @app.post("/full")
    def full() -> None:
        raise sqlite3.OperationalError("database or disk is full")  # what SQLite raises on a full disk

    return app


@pytest.fixture(scope="module")
def server():
    """uvicorn on a free port with h3's configuration (`uvicorn_config`) around `_echo_app` in h3's `Guard`."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    srv = uvicorn.Server(uvicorn_config(Guard(_echo_app(), None, 1 << 20, LIMITS.body_seconds), LIMITS))
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not srv.started:
        time.sleep(0.01)
    yield sock.getsockname()
    srv.should_exit = True
    thread.join(timeout=5)
    sock.close()


def _connect(address, sent: bytes = b"") -> socket.socket:
    conn = socket.create_connection(address, timeout=5)
    conn.sendall(sent)
    return conn


def _answer(conn: socket.socket) -> bytes:
    """One whole response: up to its content-length, else to the end (a reset after it included)."""
    out = b""
    try:
        while not _whole(out) and (chunk := conn.recv(65536)):
            out += chunk
    except ConnectionResetError:
        pass
    return out


def _whole(out: bytes) -> bool:
    head, _, body = out.partition(b"\r\n\r\n")
    lengths = [int(line.split(b":")[1]) for line in head.lower().split(b"\r\n") if line.startswith(b"content-length:")]
    return bool(_) and bool(lengths) and len(body) >= lengths[0]


def _closed_by_server(conn: socket.socket, within: float) -> bool:
    conn.settimeout(within)
    try:
        return conn.recv(1) == b""
    except (TimeoutError, socket.timeout):
        return False
    except ConnectionResetError:
        return True


def test_slow_clients_do_not_block_others_and_are_dropped_at_their_deadline(server):
    started = time.monotonic()
    silent = [_connect(server) for _ in range(10)]  # connected, nothing sent
    partial = [_connect(server, b"GET / HTTP/1.1\r\nHost: x\r\n") for _ in range(10)]  # a head never finished
    dribbling = _connect(server, b"G")
    fine = _connect(server, b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc")
    assert _answer(fine).split(b"\r\n", 1)[0] == b"HTTP/1.1 200 OK" and time.monotonic() - started < LIMITS.head_seconds
    for byte in b"ET / HTTP/1.1\r\n":  # a byte now and then: the deadline is the head's, not an idle timer
        time.sleep(LIMITS.head_seconds / 10)
        try:
            dribbling.sendall(bytes([byte]))
        except OSError:
            break
    for conn in [*silent, *partial, dribbling]:
        assert _closed_by_server(conn, within=LIMITS.head_seconds * 3), "a slow client kept its connection"
        conn.close()
    fine.close()


def test_a_kept_alive_connection_has_the_same_deadline_for_its_next_head(server):
    conn = _connect(server, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    assert b"200 OK" in _answer(conn)
    conn.sendall(b"GET / HTTP/1.1\r\n")  # the next request's head, never finished
    assert _closed_by_server(conn, within=LIMITS.head_seconds * 3)
    conn.close()


def test_a_stalled_body_is_a_408_and_a_slow_one_that_keeps_coming_is_served(server):
    stalled = _connect(server, b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\nab")
    started = time.monotonic()
    answer = _answer(stalled)
    assert answer.startswith(b"HTTP/1.1 408") and b'"code":"request_timeout"' in answer, answer
    assert LIMITS.body_seconds * 0.9 < time.monotonic() - started < LIMITS.body_seconds * 4
    stalled.close()
    slow = _connect(server, b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\n\r\n")
    for byte in b"abcd":
        time.sleep(LIMITS.body_seconds / 3)
        slow.sendall(bytes([byte]))
    assert _answer(slow).endswith(b"4")
    slow.close()


def test_headers_past_the_bound_are_a_400_and_the_server_goes_on(server):  # (h11 checks its buffer per read: about the bound)
    big = _connect(server, b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (2 * HEADER_BYTES) + b"\r\n\r\n")
    assert _answer(big).startswith(b"HTTP/1.1 400")
    big.close()
    assert b"200 OK" in _answer(_connect(server, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"))


def test_a_failing_job_queue_is_a_503_naming_it_not_a_500(server):
    answer = _answer(_connect(server, b"POST /full HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n"))
    assert answer.startswith(b"HTTP/1.1 503") and b'"code":"queue_unavailable"' in answer and b"database or disk is full" in answer, answer


# --- allowed server-local files -----------------------------------------------------------------------------


def _code(call) -> tuple[int, str]:
    with pytest.raises(ApiError) as caught:
        call()
    return caught.value.status, caught.value.code


@pytest.fixture
def roots(tmp_path):
    allowed, outside = tmp_path / "allowed", tmp_path / "outside"
    (allowed / "sub").mkdir(parents=True)
    outside.mkdir()
    (allowed / "sub" / "frame.png").write_bytes(b"inside")
    (outside / "frame.png").write_bytes(b"SECRET")
    return allowed, outside


def test_paths_that_lead_out_or_are_no_file_are_refused_without_being_opened(roots, monkeypatch):
    allowed, outside = roots
    (allowed / "link.png").symlink_to(outside / "frame.png")
    (allowed / "outdir").symlink_to(outside)
    (allowed / "zero.png").symlink_to("/dev/zero")
    os.mkfifo(allowed / "pipe.png")
    opened = []
    real_open = os.open
    monkeypatch.setattr(os, "open", lambda path, *a, **k: opened.append(str(path)) or real_open(path, *a, **k))
    refused = [f"{allowed}/../outside/frame.png", f"{allowed}/sub/../../outside/frame.png", str(allowed / "link.png"),
               str(allowed / "outdir" / "frame.png"), str(allowed / "zero.png"), str(allowed / "pipe.png"), "sub/frame.png",
               str(allowed / "sub"), f"{allowed}/sub/frame.png\x00.png", str(allowed / ("a" * 5000))]
    for text in refused:
        assert _code(lambda: read_allowed(text, [allowed.resolve()], "keyframes[first]", 1 << 20)) == (400, "path_not_allowed"), text
    assert opened == []  # not one of them was opened (a FIFO would block, a device could act)
    assert read_allowed(str(allowed / "sub" / "frame.png"), [allowed.resolve()], "k", 1 << 20) == b"inside"


def test_a_folder_swapped_for_a_link_after_the_check_leads_nowhere(roots, monkeypatch):
    """The race: `sub` passes the check, then becomes a link to `outside` before the file is opened."""
    allowed, outside = roots
    real_open = os.open

    def swap_then_open(path, *args, **kwargs):
        if (allowed / "sub").is_dir() and not (allowed / "sub").is_symlink():
            (allowed / "sub").rename(allowed / "was-sub")
            (allowed / "sub").symlink_to(outside)
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", swap_then_open)
    for read in (read_allowed, allowed_file):
        assert _code(lambda: read(str(allowed / "sub" / "frame.png"), [allowed.resolve()], "k", 1 << 20)) == (400, "path_not_allowed")
        (allowed / "sub").unlink()
        (allowed / "was-sub").rename(allowed / "sub")


def test_a_file_larger_than_the_cap_is_a_413_by_its_size(roots):
    allowed, _ = roots
    assert _code(lambda: read_allowed(str(allowed / "sub" / "frame.png"), [allowed.resolve()], "k", 3)) == (413, "file_too_large")


# --- the state directory's SQLite file --------------------------------------------------------------------------


def _queue_with_a_job(folder: Path) -> Path:
    queue = JobQueue(folder)
    queue.add({"id": "video_" + "a" * 32, "created_at": 1.0, "request": "{}", "inputs": "{}", "model": "h3", "size": "64x64",
               "seconds": "1"}, 8)
    queue.close()
    db = sqlite3.connect(folder / "jobs.sqlite3")
    db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    db.close()
    return folder / "jobs.sqlite3"


def _garbage(path: Path) -> None:
    path.write_bytes(os.urandom(8192))


def _truncated(path: Path) -> None:
    data = _queue_with_a_job(path.parent).read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _header_only(path: Path) -> None:
    path.write_bytes(_queue_with_a_job(path.parent).read_bytes()[:100])


def _damaged_pages(path: Path) -> None:
    data = bytearray(_queue_with_a_job(path.parent).read_bytes())
    for at in range(4096 + 64, len(data), 7):
        data[at] = 0xAB
    path.write_bytes(bytes(data))


def _another_programs(path: Path) -> None:
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE users (name TEXT)")
    db.commit()
    db.close()


def _another_jobs_table(path: Path) -> None:
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE jobs (id TEXT)")
    db.commit()
    db.close()


@pytest.mark.parametrize(
    "damage, words",
    [
        (_garbage, "is damaged or not a SQLite database"),
        (lambda p: p.write_text("jobs: none\n"), "is damaged or not a SQLite database"),
        (_truncated, "is damaged"),
        (_header_only, "is damaged"),
        (_damaged_pages, "is damaged"),
        (_another_programs, "is a SQLite database of something else (tables users)"),
        (_another_jobs_table, "has a jobs table without attempts"),
        (lambda p: p.mkdir(), "is a folder, not h3's SQLite job queue"),
    ],
)
def test_a_damaged_queue_file_is_one_line_naming_it_and_is_left_as_it_was(tmp_path, damage, words):
    path = tmp_path / "jobs.sqlite3"
    damage(path)
    before = path.read_bytes() if path.is_file() else None
    with pytest.raises(ConfigError) as caught:
        JobQueue(tmp_path)
    message = str(caught.value)
    assert "\n" not in message and words in message and str(path) in message and "move it aside" in message, message
    assert (path.read_bytes() if path.is_file() else None) == before  # never reset, never written


def test_an_unwritable_queue_file_says_so(tmp_path):
    from h3core.serve.queue import _sqlite_reason

    path = _queue_with_a_job(tmp_path)
    reader = sqlite3.connect(f"file:{path}?mode=ro", uri=True)  # what SQLite says of a read-only file or folder
    with pytest.raises(sqlite3.OperationalError) as caught:
        reader.execute("PRAGMA journal_mode=WAL") if os.geteuid() == 0 else None
        reader.execute("DELETE FROM jobs")
    reader.close()
    assert _sqlite_reason(caught.value).startswith("cannot be written")
    if os.geteuid() != 0:  # root writes whatever the mode says: the real refusal only for a user
        path.chmod(0o444)
        tmp_path.chmod(0o555)
        try:
            with pytest.raises(ConfigError, match="cannot be written"):
                JobQueue(tmp_path)
        finally:
            tmp_path.chmod(0o755)


def test_an_empty_file_is_an_empty_queue_and_a_good_one_keeps_its_jobs(tmp_path):
    (tmp_path / "jobs.sqlite3").write_bytes(b"")  # SQLite's own empty database: nothing in it to lose
    assert JobQueue(tmp_path).counts()["queued"] == 0
    other = tmp_path / "other"
    other.mkdir()
    _queue_with_a_job(other)
    assert JobQueue(other).counts()["queued"] == 1


# --- uploaded images: the header's verdict, silently -------------------------------------------------------------


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


@pytest.mark.parametrize(
    "chunks, code",
    [
        ([(b"IHDR", (10000, 10000))], "image_too_large"),  # past Pillow's warning threshold: no warning printed
        ([(b"IHDR", (30000, 30000))], "invalid_image"),  # past Pillow's own error threshold
        ([(b"IHDR", (16, 16)), (b"zTXt", b"k\x00\x00" + zlib.compress(b"\x00" * (64 << 20)))], "invalid_image"),
        ([(b"IHDR", (16, 16)), (b"iCCP", b"p\x00\x00" + zlib.compress(b"\x00" * (64 << 20)))], "invalid_image"),
    ],
)
def test_an_upload_whose_header_is_a_bomb_is_a_quiet_400(chunks, code):
    from h3core.serve.inputs import check_image

    body = b"".join(_png_chunk(kind, struct.pack(">IIBBBBB", *data, 8, 2, 0, 0, 0) if kind == b"IHDR" else data) for kind, data in chunks)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a warning would be printed on the server's terminal per request
        assert _code(lambda: check_image(b"\x89PNG\r\n\x1a\n" + body + _png_chunk(b"IEND", b""), "input_reference")) == (400, code)
