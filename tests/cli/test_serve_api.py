"""The API's edges on a real server (`served`): the key, errors in OpenAI's shape with the right
status and no traceback, the body cap, keyframes and adapters (uploads and allowed paths) checked, then run, ids that cannot name a path, the published schema, the page's headers,
and `h3 serve` refusing a reachable address without a key."""

from __future__ import annotations

import io
import uuid

from PIL import Image

from commands import SERVE_KEY, http, one_line

AUTH = {"authorization": f"Bearer {SERVE_KEY}"}


def _error(status: int, body, code: str) -> None:
    assert isinstance(body, dict) and set(body) == {"error"}, body
    error = body["error"]
    assert error["code"] == code and error["type"] and error["message"] and "Traceback" not in error["message"], body
    assert "\n" not in error["message"]


def _multipart(fields: dict[str, str], files: dict[str, bytes]) -> tuple[bytes, str]:
    boundary = uuid.uuid4().hex
    parts = [f'--{boundary}\r\nContent-Disposition: form-data; name="{k}"\r\n\r\n{v}\r\n'.encode() for k, v in fields.items()]
    parts += [f'--{boundary}\r\nContent-Disposition: form-data; name="{k}"; filename="f.png"\r\nContent-Type: image/png\r\n\r\n'.encode() + v + b"\r\n"
              for k, v in files.items()]
    return b"".join(parts) + f"--{boundary}--\r\n".encode(), f"multipart/form-data; boundary={boundary}"


def _post_multipart(url: str, fields: dict[str, str], files: dict[str, bytes]):
    import urllib.error
    import urllib.request
    import json

    body, kind = _multipart(fields, files)
    request = urllib.request.Request(f"{url}/v1/videos", data=body, method="POST", headers={**AUTH, "content-type": kind})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def _png() -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (16, 16), (200, 40, 40)).save(out, format="PNG")
    return out.getvalue()


def test_every_route_but_health_and_the_page_needs_the_key(served):
    for path in ("/v1/videos", "/metrics", "/openapi.json", "/v1/videos/video_" + "0" * 32):
        status, body, headers = http("GET", served.url + path)
        assert status == 401 and headers.get("www-authenticate") == "Bearer", path
        _error(status, body, "invalid_api_key")
    assert http("GET", served.url + "/v1/videos", headers={"authorization": "Bearer nope"})[0] == 401
    assert http("GET", served.url + "/health")[0] == 200
    status, page, headers = http("GET", served.url + "/")
    assert status == 200 and b"<script src=\"/static/app.js\"" in page and "default-src 'none'" in headers["content-security-policy"]
    assert b"http" not in page.lower().replace(b"http-equiv", b"")  # nothing from outside the server


def test_errors_have_openais_shape_and_status(served):
    url = served.url
    _error(*http("GET", f"{url}/v1/videos/video_{'0' * 32}", headers=AUTH)[:2], "video_not_found")
    for sneaky in ("..%2F..%2Fetc%2Fpasswd", "video_..%2F..%2Fserve.json", "video_%2E%2E"):
        status, body, _ = http("GET", f"{url}/v1/videos/{sneaky}/content", headers=AUTH)
        assert status == 404 and body["error"]["code"] in ("video_not_found", "not_found"), body
    _error(*http("POST", f"{url}/v1/videos", {"prompt": "x", "size": "huge"}, AUTH)[:2], "invalid_request")
    _error(*http("POST", f"{url}/v1/videos", {"prompt": "x", "colour": "red"}, AUTH)[:2], "invalid_request")
    _error(*http("POST", f"{url}/v1/videos", {"prompt": "x", "size": "65x64"}, AUTH)[:2], "invalid_request")  # the model's own rule
    _error(*http("POST", f"{url}/v1/videos", {"prompt": "x", "model": "sora-2"}, AUTH)[:2], "model_not_found")
    status, body, _ = http("GET", f"{url}/v1/videos?limit=1000", headers=AUTH)
    assert status == 400
    _error(status, body, "invalid_request")
    status, body, _ = http("POST", f"{url}/v1/videos", {"prompt": "x" * (3 << 20)}, AUTH)  # the server was started with a 2 MiB cap
    assert status == 413
    _error(status, body, "request_too_large")
    status, body, _ = http("DELETE", f"{url}/v1/videos/video_{'f' * 32}", headers=AUTH)
    assert status == 404


def _finished(url: str, job: str, timeout: float = 300.0) -> dict:
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status, body, _ = http("GET", f"{url}/v1/videos/{job}", headers=AUTH)
        assert status == 200, body
        if body["status"] in ("completed", "failed"):
            return body
        time.sleep(0.5)
    raise AssertionError(f"{job} did not finish in {timeout} s")


def test_keyframes_uploaded_or_named_and_adapters_run_after_their_checks(served):
    """A keyframe upload (`input_reference`), a keyframe named under --allow-path and an adapter under it
    run to a whole mp4; a file that is not an image, or a path outside the allowed folders, is one 400
    and keeps nothing."""
    from h3core.lora.synthetic import write_synthetic_adapter
    from h3core.model.config import preset

    status, body = _post_multipart(served.url, {"prompt": "a fox", "size": "64x64"}, {"input_reference": _png()})
    assert status == 200 and body["status"] == "queued", body
    uploaded = body["id"]
    (served.allowed / "last.png").write_bytes(_png())
    adapter = write_synthetic_adapter(served.allowed / "style.safetensors", preset("tiny"), rank=4)
    status, body, _ = http("POST", f"{served.url}/v1/videos", {"prompt": "a fox", "size": "64x64", "keyframes": {"last": str(served.allowed / "last.png")},
                                                               "loras": [{"path": str(adapter), "scale": 0.5}]}, AUTH)
    assert status == 200, body
    named = body["id"]
    for job in (uploaded, named):
        done = _finished(served.url, job)
        assert done["status"] == "completed" and done["progress"] == 100, done
        status, mp4, _ = http("GET", f"{served.url}/v1/videos/{job}/content", headers=AUTH)
        assert status == 200 and isinstance(mp4, bytes) and mp4[4:8] == b"ftyp"
    status, body = _post_multipart(served.url, {"prompt": "a fox"}, {"input_reference": b"not an image"})
    assert status == 400 and body["error"]["code"] == "invalid_image", body
    status, body, _ = http("POST", f"{served.url}/v1/videos", {"prompt": "a fox", "keyframes": {"last": "/etc/hostname"}}, AUTH)
    assert status == 400 and body["error"]["code"] == "path_not_allowed", body


def test_the_schema_is_published(served):
    status, schema, _ = http("GET", f"{served.url}/openapi.json", headers=AUTH)
    assert status == 200 and {"/v1/videos", "/v1/videos/{video_id}", "/v1/videos/{video_id}/content", "/health", "/metrics"} <= set(schema["paths"])
    assert "Video" in schema["components"]["schemas"]


def test_a_reachable_address_without_a_key_is_refused_in_one_line(h3, monkeypatch, tmp_path):
    monkeypatch.delenv("H3_API_KEY", raising=False)
    code, _, err = h3("serve", "--host", "0.0.0.0", "--state-dir", str(tmp_path / "s"))
    assert code == 2 and "--host 0.0.0.0 is reachable from other machines: give --api-key" in one_line(err)
    assert not (tmp_path / "s").exists()
