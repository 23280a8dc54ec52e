"""Hostile requests against a real `h3 serve` (issue 36, the new surfaces): bodies (deep, huge, wrong
types, out-of-range counts, unknown fields), uploads (oversized, not an image, too many), ids, headers
and allowed-path keyframes that lead out. Each is one error in OpenAI's shape with a 4xx status, no
traceback, and nothing kept: no job, no input folder. And `h3 serve` on a damaged queue file is one
line naming it, the file untouched."""

from __future__ import annotations

import io
import json
import socket
import urllib.error
import urllib.parse
import urllib.request
import uuid

import pytest
from PIL import Image

from commands import SERVE_KEY, http, one_line

AUTH = {"authorization": f"Bearer {SERVE_KEY}"}


def _post(url: str, data: bytes, kind: str = "application/json") -> tuple[int, dict]:
    request = urllib.request.Request(f"{url}/v1/videos", data=data, method="POST", headers={**AUTH, "content-type": kind})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def _multipart(fields: list[tuple[str, str]], files: list[tuple[str, bytes]]) -> tuple[bytes, str]:
    boundary = uuid.uuid4().hex
    parts = [f'--{boundary}\r\nContent-Disposition: form-data; name="{k}"\r\n\r\n{v}\r\n'.encode() for k, v in fields]
    parts += [f'--{boundary}\r\nContent-Disposition: form-data; name="{k}"; filename="f.png"\r\nContent-Type: image/png\r\n\r\n'.encode() + v + b"\r\n"
              for k, v in files]
    return b"".join(parts) + f"--{boundary}--\r\n".encode(), f"multipart/form-data; boundary={boundary}"


def _png(width: int = 16, height: int = 16) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), (10, 200, 30)).save(out, format="PNG")
    return out.getvalue()


def _kept(served) -> tuple[set, set]:
    """Every job id the server holds, and every input folder in its state directory."""
    status, body, _ = http("GET", f"{served.url}/v1/videos?limit=100", headers=AUTH)
    assert status == 200, body
    inputs = served.state / "inputs"
    return {job["id"] for job in body["data"]}, set(inputs.iterdir()) if inputs.is_dir() else set()


def _refused(status: int, body: dict, code: str, words: str = "", expected: int = 400) -> None:
    assert status == expected and set(body) == {"error"}, (status, body)
    error = body["error"]
    assert error["code"] == code and "\n" not in error["message"] and "Traceback" not in error["message"], body
    assert words in error["message"], error["message"]
    assert len(error["message"]) < 800, error["message"]


DEEP = b"[" * 100_000 + b"]" * 100_000

BODIES = [
    (b'{"prompt": ' + DEEP + b"}", "invalid_json", "nested deeper than 100 levels"),
    (b'{"prompt": "x", "loras": ' + DEEP + b"}", "invalid_json", "nested deeper than 100 levels"),
    (b'{"prompt": "x", "seed": ' + b"9" * 5000 + b"}", "invalid_json", "a number of 5000 characters"),
    (b'{"prompt": "x", "steps": 1e999}', "invalid_request", "steps"),
    (b"[1, 2]", "invalid_json", "a JSON array, not an object"),
    (b"null", "invalid_json", "a JSON null, not an object"),
    (b'{"prompt": "\xff"}', "invalid_json", "not UTF-8"),
    (b"{", "invalid_json", "not valid JSON"),
    (json.dumps({"prompt": "x", "steps": "3"}).encode(), "invalid_request", "steps: Input should be a valid integer"),
    (json.dumps({"prompt": "x", "steps": True}).encode(), "invalid_request", "steps: Input should be a valid integer"),
    (json.dumps({"prompt": "x", "seed": 1.0}).encode(), "invalid_request", "seed"),
    (json.dumps({"prompt": "x", "guidance": True}).encode(), "invalid_request", "guidance"),
    (json.dumps({"prompt": 5}).encode(), "invalid_request", "prompt"),
    (json.dumps({"prompt": "x", "keyframes": {"first": 5}}).encode(), "invalid_request", "keyframes.first"),
    (json.dumps({"prompt": "x", "loras": [{"path": "/a", "scale": True}]}).encode(), "invalid_request", "loras.0.scale"),
    (json.dumps({"prompt": "x", "loras": [{"path": "/a", "scale": 1e9}]}).encode(), "invalid_request", "loras.0.scale"),
    (json.dumps({"prompt": "x", "steps": -3}).encode(), "invalid_request", "steps"),
    (json.dumps({"prompt": "x", "steps": 5001}).encode(), "invalid_request", "steps 5001 is more than this server runs for one request (5000)"),
    (json.dumps({"prompt": "x", "frames": 500}).encode(), "invalid_request", "frames"),
    (json.dumps({"prompt": "x", "frames": 10**12}).encode(), "invalid_request", "frames"),
    (json.dumps({"prompt": "x", "seconds": 3600}).encode(), "invalid_request", "more than this server makes for one request (481)"),
    (json.dumps({"prompt": "x", "seconds": "-1"}).encode(), "invalid_request", "seconds"),
    (json.dumps({"prompt": "x", "size": "0x0"}).encode(), "invalid_request", ""),
    (json.dumps({"prompt": "x", "size": "99999x99999"}).encode(), "invalid_request", ""),
    (json.dumps({"prompt": "x", "size": "64x64x64"}).encode(), "invalid_request", "size"),
    (json.dumps({"prompt": "x", "guidance": 1e300}).encode(), "invalid_request", "guidance"),
    (json.dumps({"prompt": "x", "colour": "red"}).encode(), "invalid_request", "colour: Extra inputs are not permitted"),
    (json.dumps({"prompt": "x", "keyframes": {"middle": "/a.png"}}).encode(), "invalid_request", "keyframes.middle"),
    (json.dumps({"prompt": ""}).encode(), "invalid_request", "prompt"),
]


@pytest.mark.parametrize("data, code, words", BODIES, ids=[f"body{i}" for i in range(len(BODIES))])
def test_a_hostile_json_body_is_one_4xx_and_keeps_nothing(served, data, code, words):
    before = _kept(served)
    _refused(*_post(served.url, data), code, words)
    assert _kept(served) == before


def test_a_body_over_the_cap_is_a_413_by_its_length_or_as_it_streams(served):
    status, body = _post(served.url, json.dumps({"prompt": "x" * (3 << 20)}).encode())  # the server's cap is 2 MiB
    _refused(status, body, "request_too_large", "2,097,152 bytes", expected=413)
    with socket.create_connection((served.base.split(":")[0], int(served.base.split(":")[1])), timeout=30) as conn:
        head = f"POST /v1/videos HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {SERVE_KEY}\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
        conn.sendall(head.encode())
        answer = b""
        try:
            for _ in range(3):
                conn.sendall(b"100000\r\n" + b" " * 0x100000 + b"\r\n")
            conn.sendall(b"0\r\n\r\n")
            while not _whole(answer) and (chunk := conn.recv(65536)):
                answer += chunk
        except (ConnectionResetError, BrokenPipeError):
            pass
    assert answer.startswith(b"HTTP/1.1 413") and b"2,097,152 bytes" in answer, answer[:300]


def _whole(answer: bytes) -> bool:
    head, gap, body = answer.partition(b"\r\n\r\n")
    lengths = [int(line.split(b":")[1]) for line in head.lower().split(b"\r\n") if line.startswith(b"content-length:")]
    return bool(gap) and bool(lengths) and len(body) >= lengths[0]


UPLOADS = [
    ([("prompt", "x")], [("input_reference", b"not an image")], "invalid_image", "is not an image h3 can read"),
    ([("prompt", "x")], [("input_reference", b"\x89PNG\r\n\x1a\n" + b"\x00" * 64)], "invalid_image", ""),
    ([("prompt", "x")], [("input_reference", _png())] * 4, "invalid_request", "Too many files"),
    ([("prompt", "x")], [("input_reference", _png()), ("keyframes[first]", _png())], "invalid_request", "two images for the first keyframe"),
    ([("prompt", "x")], [("avatar", _png())], "invalid_request", "unknown file field 'avatar'"),
    ([("prompt", "x")] * 40, [], "invalid_request", "Too many fields"),
    ([("prompt", "x" * ((1 << 20) + 10))], [], "invalid_request", "Part exceeded maximum size"),
    ([("prompt", "x"), ("loras", "[" * 5000 + "]" * 5000)], [], "invalid_json", "loras (a form field): JSON nested deeper"),
    ([("prompt", "x"), ("loras", '{"path": "/a"}')], [], "invalid_json", "a JSON object, not a array"),
    ([("prompt", "x"), ("steps", "many")], [], "invalid_request", "steps"),
    ([("prompt", "x"), ("color", "red")], [], "invalid_request", "unknown field 'color'"),
]


@pytest.mark.parametrize("fields, files, code, words", UPLOADS, ids=[f"upload{i}" for i in range(len(UPLOADS))])
def test_a_hostile_upload_is_one_4xx_and_keeps_nothing(served, fields, files, code, words):
    before = _kept(served)
    _refused(*_post(served.url, *_multipart(fields, files)), code, words)
    assert _kept(served) == before


def test_an_image_with_too_many_pixels_or_a_gif_is_refused_from_its_header(served):
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    bomb = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 30000, 30000, 8, 2, 0, 0, 0)) + chunk(b"IEND", b"")
    gif = io.BytesIO()
    Image.new("RGB", (8, 8)).save(gif, format="GIF")
    before = _kept(served)
    _refused(*_post(served.url, *_multipart([("prompt", "x")], [("input_reference", bomb)])), "invalid_image")
    _refused(*_post(served.url, *_multipart([("prompt", "x")], [("input_reference", gif.getvalue())])), "invalid_image", "is a GIF image")
    assert _kept(served) == before


@pytest.mark.parametrize("content_type", ["text/plain", "", "application/xml", "multipart/form-data", "multipart/form-data; boundary=zz"])
def test_a_body_of_another_content_type_is_one_400(served, content_type):
    status, body = _post(served.url, b'{"prompt": "x"}', content_type)
    assert status == 400 and body["error"]["code"] in ("invalid_content_type", "invalid_request"), body


@pytest.mark.parametrize("video_id", ["video_" + "0" * 32 + "x" * 5000, "vidéo_ü", "%00", "video_%2E%2E%2F%2E%2E%2Fserve.json", "..%2F..%2Fetc"])
def test_ids_that_are_no_job_id_are_a_404_that_echoes_little(served, video_id):
    video_id = urllib.parse.quote(video_id, safe="%")
    for path in (f"/v1/videos/{video_id}", f"/v1/videos/{video_id}/content"):
        status, body, _ = http("GET", served.url + path, headers=AUTH)
        assert status == 404 and body["error"]["code"] in ("video_not_found", "not_found") and len(body["error"]["message"]) < 200, body
    status, body, _ = http("DELETE", f"{served.url}/v1/videos/{video_id}", headers=AUTH)
    assert status in (404, 405), body


def test_huge_headers_are_a_400_and_the_server_goes_on(served):
    host, port = served.base.split(":")
    with socket.create_connection((host, int(port)), timeout=30) as conn:
        try:
            conn.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (256 << 10) + b"\r\n\r\n")
        except (ConnectionResetError, BrokenPipeError):
            pass
        try:
            answer = conn.recv(4096)
        except ConnectionResetError:
            answer = b""
    assert answer == b"" or answer.startswith(b"HTTP/1.1 400"), answer
    assert http("GET", f"{served.url}/health")[0] == 200


def test_allowed_path_keyframes_that_lead_out_are_refused(served, tmp_path):
    secret = tmp_path / "secret.png"
    secret.write_bytes(_png())
    link = served.allowed / "escape.png"
    if not link.is_symlink():
        link.symlink_to(secret)
    folder_link = served.allowed / "elsewhere"
    if not folder_link.is_symlink():
        folder_link.symlink_to(tmp_path)
    before = _kept(served)
    climbing = f"{served.allowed}{'/..' * len(served.allowed.parts)}{secret}"  # `..` up to / and down again
    for path in (str(link), str(folder_link / "secret.png"), climbing, "escape.png", str(served.allowed), str(served.allowed / "absent.png")):
        status, body, _ = http("POST", f"{served.url}/v1/videos", {"prompt": "x", "keyframes": {"first": path}}, AUTH)
        _refused(status, body, "path_not_allowed", "is not a file under a directory this server allows")
    status, body, _ = http("POST", f"{served.url}/v1/videos", {"prompt": "x", "loras": [{"path": str(folder_link / "secret.png")}]}, AUTH)
    _refused(status, body, "path_not_allowed")
    assert _kept(served) == before


def test_serve_on_a_damaged_queue_file_is_one_line_and_leaves_it(h3, tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    damaged = state / "jobs.sqlite3"
    damaged.write_bytes(b"SQLite format 3\x00" + bytes(range(256)) * 16)
    before = damaged.read_bytes()
    code, out, err = h3("serve", "--port", "0", "--state-dir", str(state), "--width", "64", "--height", "64", "--frames", "22", "--steps", "3")
    line = one_line(err)
    assert code == 2 and str(damaged) in line and "move it aside" in line and "Traceback" not in err, err
    assert damaged.read_bytes() == before
