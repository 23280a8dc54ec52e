"""A stand-in for RunPod's REST API v2 on 127.0.0.1: real HTTP, bearer auth, OpenAPI-checked.

It implements the endpoints `h3 pod` uses with a small in-memory account (GPU stock per data
center, pods, network volumes, SSH keys) and:

- answers 401 unless `Authorization: Bearer <key>` matches,
- validates query parameters and JSON bodies against `tests/data/runpod-openapi-v2-subset.json`
  (RunPod's own OpenAPI file, trimmed): an unknown field or bad value gets the API's 422/400,
- validates every answer it gives against the same file and records any mismatch in
  `contract_violations` (the fixture fails the test on one), so the fake cannot drift into
  shapes the real API never returns,
- records each request (`requests`) so tests can assert what was, and was not, sent,
- can be scripted to fail or stall the next matching requests (`script`), or to misbehave below
  HTTP's surface: answer with raw bytes (a broken chunked body, gzip garbage, a redirect loop),
  with a stream of them that may never end (an endless body, a gzip bomb: `raw` a callable), or
  trickle an answer one byte at a time from any point on (`trickle_s`, `trickle_from`: e.g. an
  HTTP/1.0 answer whose headers come at once and whose body trickles).
"""

from __future__ import annotations

import copy
import functools
import json
import pathlib
import threading
import urllib.parse
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Iterable, Optional

from jsonschema import Draft202012Validator
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

SPEC_PATH = pathlib.Path(__file__).parent / "data" / "runpod-openapi-v2-subset.json"
_URN = "urn:runpod-openapi-v2"
_LEVELS = ["NONE", "LOW", "MEDIUM", "HIGH"]

# The key tests use; every CLI test checks that it never shows up in any output.
TEST_KEY = "rpa_TESTKEY0123456789abcdefSECRET"
SERVER_EDITION = "NVIDIA RTX PRO 6000 Blackwell Server Edition"
WORKSTATION_EDITION = "NVIDIA RTX PRO 6000 Blackwell Workstation Edition"


class OpenAPI:
    """Request and response checks against the OpenAPI document (JSON Schema 2020-12)."""

    def __init__(self, path: pathlib.Path = SPEC_PATH):
        self.doc = json.loads(path.read_text())
        resource = Resource.from_contents(self.doc, default_specification=DRAFT202012)
        self.registry = Registry().with_resource(_URN, resource)
        self.templates = list(self.doc["paths"])

    def errors(self, schema: dict, instance: Any) -> list[str]:
        validator = Draft202012Validator(self._absolute(schema), registry=self.registry)
        return [f"{e.json_path}: {e.message}" for e in validator.iter_errors(instance)]

    def route(self, method: str, path: str) -> Optional[tuple[str, dict]]:
        """(path template, operation) for a concrete path, or None when the API has no such route."""
        parts = path.strip("/").split("/")
        for template in self.templates:
            tparts = template.strip("/").split("/")
            if len(tparts) == len(parts) and all(t.startswith("{") or t == p for t, p in zip(tparts, parts, strict=True)):
                operation = self.doc["paths"][template].get(method.lower())
                if operation is not None:
                    return template, operation
        return None

    def query_errors(self, operation: dict, query: dict[str, str]) -> list[str]:
        declared = {p["name"]: p for p in map(self._resolve, operation.get("parameters", [])) if p["in"] == "query"}
        problems = [f"unknown query parameter {name!r}" for name in query if name not in declared]
        for name, value in query.items():
            if name in declared:
                problems += [f"{name}: {e}" for e in self._param_errors(declared[name]["schema"], value)]
        return problems

    def body_errors(self, operation: dict, body: Any) -> list[str]:
        schema = operation["requestBody"]["content"]["application/json"]["schema"]
        return self.errors(schema, body)

    def response_errors(self, operation: dict, status: int, body: Any) -> list[str]:
        responses = operation["responses"]
        spec = self._resolve(responses.get(str(status)) or responses.get("default") or {})
        content = spec.get("content")
        if not content:
            return [] if body is None else [f"HTTP {status} must have no body"]
        schema = next(iter(content.values()))["schema"]
        return self.errors(schema, body)

    def _param_errors(self, schema: dict, raw: str) -> list[str]:
        schema = self._resolve(schema)
        kind = schema.get("type")
        try:
            value: Any = raw.split(",") if kind == "array" else int(raw) if kind == "integer" else raw
        except ValueError:
            return [f"{raw!r} is not an integer"]
        return self.errors(schema, value)

    def _resolve(self, node: dict) -> dict:
        """Follow a local `$ref` (e.g. '#/components/parameters/GpuCountFilter') to its target."""
        while "$ref" in node:
            target: Any = self.doc
            for key in node["$ref"].lstrip("#/").split("/"):
                target = target[key]
            node = target
        return node

    def _absolute(self, node: Any) -> Any:
        if isinstance(node, dict):
            return {k: (_URN + v if k == "$ref" and v.startswith("#") else self._absolute(v)) for k, v in node.items()}
        if isinstance(node, list):
            return [self._absolute(v) for v in node]
        return node


@functools.lru_cache(maxsize=1)
def _spec() -> OpenAPI:
    return OpenAPI()


@dataclass
class Stock:
    """One data center's stock of one GPU type: `free` GPUs on one machine, at `level` when enough."""

    datacenter: str
    name: str
    level: str
    free: int
    cloud: str = "SECURE"
    cuda: str = "13.0"

    def availability(self, count: int) -> str:
        return self.level if count <= self.free else "NONE"


@dataclass
class Recorded:
    method: str
    path: str
    query: dict[str, str]
    body: Any
    authorized: bool


@dataclass
class Script:
    """Answer the next `times` requests matching method and path with this (or stall them)."""

    method: str
    path: str
    status: int = 500
    body: Any = None
    headers: dict[str, str] = field(default_factory=dict)
    times: int = 1
    stall: bool = False
    raw: Optional[bytes | Callable[[], Iterable[bytes]]] = None  # the whole answer, verbatim (a callable: its chunks, maybe endless)
    trickle_s: float = 0.0  # > 0: the answer is sent one byte at a time, this long apart
    trickle_from: int = 0  # bytes sent at once before the trickle starts (e.g. the whole head)


def _gpu_type(gpu_id: str, name: str, secure: float, community: float) -> dict:
    return {
        "id": gpu_id, "name": name, "pool": None, "manufacturer": "NVIDIA", "memory": 96,
        "secure": True, "community": True, "price": {"secure": secure, "community": community},
        "maxCount": {"secure": 8, "community": 8},
    }


def _cuda_at_least(version: str, floor: Optional[str]) -> bool:
    if not floor:
        return True
    as_tuple = lambda v: tuple(int(p) for p in v.split("."))  # noqa: E731
    return as_tuple(version) >= as_tuple(floor if "." in floor else floor + ".0")


def problem(status: int, title: str, detail: str, errors: Optional[list[str]] = None) -> dict:
    body = {"title": title, "status": status, "detail": detail}
    if errors:
        body["errors"] = errors
    return body


class FakeRunPod:
    """The account and the HTTP server. `start()` binds 127.0.0.1 on a free port."""

    def __init__(self, api_key: str):
        self.api_key = api_key
        self.spec = _spec()
        self.gpu_types = {
            SERVER_EDITION: _gpu_type(SERVER_EDITION, "RTX PRO 6000", 1.89, 1.59),
            WORKSTATION_EDITION: _gpu_type(WORKSTATION_EDITION, "RTX PRO 6000 WK", 1.79, 1.49),
        }
        self.stock: dict[str, list[Stock]] = {
            SERVER_EDITION: [
                Stock("US-KS-2", "US Kansas 2", "MEDIUM", 8),
                Stock("EUR-IS-1", "Europe Iceland 1", "HIGH", 16),
                Stock("US-TX-3", "US Texas 3", "LOW", 4),
                Stock("CA-MTL-1", "Canada Montreal 1", "HIGH", 8, cuda="12.8"),
                Stock("EU-RO-1", "Europe Romania 1", "LOW", 8, cloud="COMMUNITY"),
            ],
            WORKSTATION_EDITION: [Stock("US-KS-2", "US Kansas 2", "LOW", 2)],
        }
        self.volumes = {"vol1234567": {"id": "vol1234567", "name": "h3-data", "size": 200, "dataCenter": "US-KS-2", "type": "STANDARD"}}
        self.ssh_keys: list[str] = ["ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIExampleExampleExampleExampleExample me@laptop"]
        self.pods: dict[str, dict] = {}
        self.requests: list[Recorded] = []
        self.scripts: list[Script] = []
        self.contract_violations: list[str] = []
        self.release = threading.Event()
        self._lock = threading.Lock()
        self._next_id = 0
        self._server: Optional[ThreadingHTTPServer] = None

    # --- lifecycle ------------------------------------------------------------------------------

    def start(self) -> "FakeRunPod":
        fake = self

        class Handler(_Handler):
            runpod = fake

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, args=(0.02,), name="fake-runpod", daemon=True).start()
        return self

    def stop(self) -> None:
        self.release.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    @property
    def base_url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    # --- test helpers -----------------------------------------------------------------------------

    def script(self, method: str, path: str, status: int = 500, body: Any = None, *, headers: Optional[dict] = None,
               times: int = 1, stall: bool = False, raw: Optional[bytes | Callable[[], Iterable[bytes]]] = None,
               trickle_s: float = 0.0, trickle_from: int = 0) -> None:
        if body is None and not stall and raw is None and status >= 400:
            body = problem(status, "Internal Server Error" if status >= 500 else "Error", f"scripted {status}")
        self.scripts.append(Script(method, path, status, body, headers or {}, times, stall, raw, trickle_s, trickle_from))

    def sent(self, method: str, path: Optional[str] = None) -> list[Recorded]:
        return [r for r in self.requests if r.method == method and (path is None or r.path == path)]

    def add_pod(self, **overrides: Any) -> dict:
        """A RUNNING pod with a direct SSH endpoint, stored and returned."""
        pod = self._new_pod(
            {"name": "h3-8gpu", "image": "runpod/pytorch:1.0.3-cu1300-torch291-ubuntu2404",
             "gpu": {"id": SERVER_EDITION, "count": 8}, "cloud": "SECURE", "disk": 50, "ports": ["22/tcp"],
             "env": {}, "mounts": {"persistent": {"size": 100, "path": "/workspace"}}},
            "US-KS-2", "13.0",
        )
        self.set_running(pod["id"])
        pod.update(overrides)
        return pod

    def set_running(self, pod_id: str) -> dict:
        pod = self.pods[pod_id]
        pod["status"] = "RUNNING"
        pod["actions"] = ["stop", "restart", "terminate"]
        pod["ssh"]["direct"] = {"host": "203.0.113.7", "port": 40022, "username": "root",
                                "command": "ssh root@203.0.113.7 -p 40022"}
        count = pod["gpu"]["count"]
        pod["runtime"] = {"uptime": 120, "gpus": [{"util": 0, "memoryUtil": 1}] * count,
                          "ports": [{"private": 22, "public": 40022, "type": "tcp", "ip": "203.0.113.7"}]}
        pod["startedAt"] = "2026-06-01T12:02:00Z"
        return pod

    # --- request handling -----------------------------------------------------------------------

    def handle(self, method: str, raw_path: str, headers: Any, raw_body: bytes) -> tuple[int, dict[str, str], Any, Any]:
        """(status, headers, JSON body or None, how: False, True (stall) or the Script that misbehaves) for one request."""
        url = urllib.parse.urlsplit(raw_path)
        path = urllib.parse.unquote(url.path)
        query = {k: v[-1] for k, v in urllib.parse.parse_qs(url.query, keep_blank_values=True).items()}
        authorized = headers.get("Authorization") == f"Bearer {self.api_key}"
        body = json.loads(raw_body) if raw_body else None
        with self._lock:
            self.requests.append(Recorded(method, path, query, body, authorized))
        if not headers.get("Authorization"):
            return 401, {}, problem(401, "Unauthorized", "missing bearer token"), False
        if not authorized:
            return 401, {}, problem(401, "Unauthorized", "invalid bearer token"), False
        route = self.spec.route(method, url.path)
        if route is None:
            return 404, {}, problem(404, "Not Found", f"no route {method} {path}"), False
        _, operation = route
        with self._lock:
            script = self._take_script(method, path)
        if script is not None and (script.raw is not None or script.trickle_s):
            return script.status, script.headers, script.body, script  # misbehaving on purpose: no contract check
        if script is not None:
            return self._answer(operation, script.status, script.headers, script.body, script.stall)
        bad_query = self.spec.query_errors(operation, query)
        if bad_query:
            return self._answer(operation, 422, {}, problem(422, "Unprocessable Entity", "Request validation failed.", bad_query))
        if "requestBody" in operation:
            bad_body = self.spec.body_errors(operation, body)
            if bad_body:
                return self._answer(operation, 422, {}, problem(422, "Unprocessable Entity", "Request validation failed.", bad_body))
        handler = getattr(self, "_" + operation["operationId"])
        status, answer = handler(path.strip("/").split("/"), query, body)
        return self._answer(operation, status, {}, answer)

    def _answer(self, operation: dict, status: int, headers: dict, body: Any, stall: bool = False):
        if not stall:
            for error in self.spec.response_errors(operation, status, body):
                self.contract_violations.append(f"{operation['operationId']} HTTP {status}: {error}")
        return status, headers, body, stall

    def _take_script(self, method: str, path: str) -> Optional[Script]:
        for script in self.scripts:
            if script.method == method and script.path == path and script.times > 0:
                script.times -= 1
                return script
        return None

    # --- endpoints (named after operationId) -----------------------------------------------------

    def _getGpuType(self, parts: list[str], query: dict[str, str], _: Any) -> tuple[int, Any]:  # noqa: N802
        gpu_id = parts[-1]
        if gpu_id not in self.gpu_types:
            return 404, problem(404, "Not Found", f"gpu type {gpu_id!r} not found")
        include = "include" in query
        if include != ("product" in query):
            return 400, problem(400, "Bad Request", "include=AVAILABILITY and product go together")
        if not include and any(k in query for k in ("count", "cloud", "minCudaVersion")):
            return 400, problem(400, "Bad Request", "count, cloud and minCudaVersion need include=AVAILABILITY")
        gpu = copy.deepcopy(self.gpu_types[gpu_id])
        if include:
            gpu.update(self._availability(gpu_id, int(query.get("count", "1")), query.get("cloud", "SECURE"), query.get("minCudaVersion")))
        return 200, gpu

    def _availability(self, gpu_id: str, count: int, cloud: str, min_cuda: Optional[str]) -> dict:
        offered = [s for s in self.stock.get(gpu_id, []) if s.cloud == cloud and _cuda_at_least(s.cuda, min_cuda)]
        levels = [s.availability(count) for s in offered]
        result: dict[str, Any] = {"availability": max(levels, key=_LEVELS.index, default="NONE")}
        if any(level != "NONE" for level in levels):
            result["dataCenters"] = [{"id": s.datacenter, "name": s.name, "availability": s.availability(count)} for s in offered]
        versions = sorted({s.cuda for s in offered})
        if versions:
            result["cudaVersions"] = [
                {"version": v, "available": any(s.cuda == v and s.availability(count) != "NONE" for s in offered)} for v in versions
            ]
        return result

    def _getNetworkVolume(self, parts: list[str], _q: dict, _b: Any) -> tuple[int, Any]:  # noqa: N802
        volume = self.volumes.get(parts[-1])
        return (200, volume) if volume else (404, problem(404, "Not Found", "network volume not found"))

    def _getSshKeys(self, _p: list[str], _q: dict, _b: Any) -> tuple[int, Any]:  # noqa: N802
        return 200, {"keys": list(self.ssh_keys)}

    def _listPods(self, _p: list[str], _q: dict, _b: Any) -> tuple[int, Any]:  # noqa: N802
        return 200, {"pods": list(self.pods.values())}

    def _getPod(self, parts: list[str], _q: dict, _b: Any) -> tuple[int, Any]:  # noqa: N802
        pod = self.pods.get(parts[-1])
        return (200, pod) if pod else (404, problem(404, "Not Found", "pod not found"))

    def _deletePod(self, parts: list[str], _q: dict, _b: Any) -> tuple[int, Any]:  # noqa: N802
        if self.pods.pop(parts[-1], None) is None:
            return 404, problem(404, "Not Found", "pod not found")
        return 204, None

    def _createPod(self, _p: list[str], _q: dict, body: dict) -> tuple[int, Any]:  # noqa: N802
        if ("gpu" in body) == ("cpu" in body):
            return 400, problem(400, "Bad Request", "exactly one of gpu or cpu must be set")
        mounts = body.get("mounts", {})
        if "persistent" in mounts and "network" in mounts:
            return 400, problem(400, "Bad Request", "mounts.persistent and mounts.network are mutually exclusive")
        gpu = body["gpu"]
        if gpu["id"] not in self.gpu_types:
            return 400, problem(400, "Bad Request", f"unknown gpu type {gpu['id']!r}")
        place = self._placement(gpu, body.get("cloud", "SECURE"), body.get("dataCenterIds") or [])
        if place is None:
            return 400, problem(400, "Bad Request", "There are no longer any instances available with the requested specifications.")
        for mount in mounts.get("network", []):
            volume = self.volumes.get(mount["volumeId"])
            if volume is None or volume["dataCenter"] != place.datacenter:
                return 400, problem(400, "Bad Request", f"network volume {mount['volumeId']} is not in {place.datacenter}")
        return 201, self._new_pod(body, place.datacenter, place.cuda)

    def _placement(self, gpu: dict, cloud: str, datacenters: list[str]) -> Optional[Stock]:
        count = gpu.get("count", 1)
        for stock in self.stock.get(gpu["id"], []):
            if stock.cloud != cloud or stock.availability(count) == "NONE":
                continue
            if datacenters and stock.datacenter not in datacenters:
                continue
            if _cuda_at_least(stock.cuda, gpu.get("minCudaVersion")):
                return stock
        return None

    def _new_pod(self, body: dict, datacenter: str, cuda: str) -> dict:
        self._next_id += 1
        pod_id = f"pod{self._next_id:07d}"
        gpu = {"id": body["gpu"]["id"], "count": body["gpu"].get("count", 1)}
        price = self.gpu_types[gpu["id"]]["price"][body.get("cloud", "SECURE").lower()]
        pod = {
            "id": pod_id, "name": body["name"], "image": body["image"], "args": "", "disk": body.get("disk", 20),
            "ports": body.get("ports", []), "env": dict(body.get("env", {})), "registry": None,
            "status": "PROVISIONING", "actions": ["stop", "terminate"], "mounts": body.get("mounts", {}),
            "gpu": gpu, "cloud": body.get("cloud", "SECURE"), "dataCenterId": datacenter, "cudaVersion": cuda,
            "ssh": {"proxy": {"host": "ssh.runpod.io", "port": 22, "username": f"{pod_id}-64411eb2",
                              "command": f"ssh {pod_id}-64411eb2@ssh.runpod.io"}, "direct": None},
            "template": None, "cost": round(price * gpu["count"], 4), "locked": False,
            "globalNetworking": {"enabled": False}, "runtime": None,
            "createdAt": "2026-06-01T12:00:00Z", "startedAt": None,
        }
        self.pods[pod_id] = pod
        return pod


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    runpod: FakeRunPod

    def do_GET(self) -> None:  # noqa: N802
        self._serve("GET")

    def do_POST(self) -> None:  # noqa: N802
        self._serve("POST")

    def do_DELETE(self) -> None:  # noqa: N802
        self._serve("DELETE")

    def _serve(self, method: str) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        status, headers, body, stall = self.runpod.handle(method, self.path, self.headers, raw)
        if isinstance(stall, Script):
            self._misbehave(stall, status, headers, body)
            return
        if stall:
            self.runpod.release.wait(10)
            self.close_connection = True
            return
        payload = b"" if body is None else json.dumps(body).encode()
        try:
            self.send_response(status)
            kind = "application/problem+json" if status >= 400 else "application/json"
            if payload:
                self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(payload)))
            for name, value in headers.items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(payload)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True

    def _misbehave(self, script: Script, status: int, headers: dict, body: Any) -> None:
        """The raw bytes of `script` (or its stream of them), or a valid answer, trickled byte by byte from `trickle_from` on."""
        self.close_connection = True
        if callable(script.raw):
            self._send_stream(script.raw())
            return
        if script.raw is not None:
            data = script.raw
        else:
            payload = b"" if body is None else json.dumps(body).encode()
            head = f"HTTP/1.1 {status} OK\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {len(payload)}\r\n"
            head += "".join(f"{k}: {v}\r\n" for k, v in headers.items())
            data = (head + "\r\n").encode() + payload
        try:
            if not script.trickle_s:
                self.wfile.write(data)
                return
            self.wfile.write(data[: script.trickle_from])
            self.wfile.flush()
            for i in range(script.trickle_from, len(data)):
                if self.runpod.release.wait(script.trickle_s):
                    return
                self.wfile.write(data[i : i + 1])
                self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            pass

    def _send_stream(self, chunks: Iterable[bytes]) -> None:
        """Chunks until they end, the client goes away or the server stops."""
        try:
            for chunk in chunks:
                if self.runpod.release.is_set():
                    return
                self.wfile.write(chunk)
        except (BrokenPipeError, ConnectionResetError):
            pass

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        pass
