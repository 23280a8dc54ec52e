"""The HTTP side of `h3 serve`: a FastAPI application over the queue and the engine's state.

Routes (docs/serve.md has the table): `POST /v1/videos`, `GET /v1/videos`, `GET /v1/videos/{id}`,
`GET /v1/videos/{id}/content`, `DELETE /v1/videos/{id}`, `GET /health`, `GET /metrics`,
`GET /openapi.json` (the schema FastAPI builds from the models), and the page (`GET /`, its script and
style, shipped in the package). FastAPI's own docs pages are off: they load their code from a CDN.

One guard in front of every route (`Guard`, plain ASGI): with an API key, every route but
`/health` and the page's three static files (which hold no data: the page sends the key it is given
with each call) needs `Authorization: Bearer <key>` (401 otherwise); a body over the cap is a 413
before it is read whole (by its Content-Length, else while it streams); a body that stalls for
`Limits.body_seconds` is a 408 (a request's head has its own deadline: `server.HeadDeadline`).

A JSON body is read by h3's one JSON reader (`h3core.files.text`: bounded in depth and in the length
of its numbers) and validated strictly (`"steps": "5"` or `true` is a 400, not a 5 or a 1); a form's
fields are text by nature and are converted as pydantic's lax mode does. A request may ask for at
most `Limits.steps` sigma points and `Limits.frames` frames. Every error is OpenAI's shape
(`ApiError.body`); an unexpected one is a 500 that says only that (its traceback goes to the server's
stderr with H3_DEBUG=1), never a traceback to a client. A failure of the job queue's SQLite file at run
time (a full disk) is a 503 naming it, with the request's saved inputs removed.
"""

from __future__ import annotations

import asyncio
import hmac
import secrets
import sqlite3
import sys
import time
import traceback
from importlib import resources
from pathlib import Path
from typing import Any, Literal

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse, Response
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException as StarletteHTTPException

from h3core import settings
from h3core.errors import ConfigError
from h3core.files.text import parse_json
from h3core.serve.api import JOB_ID, ApiError, Health, Video, VideoCreate, VideoDeleted, VideoError, VideoList, not_found
from h3core.serve.engine import ServerState, frames_seconds, plan_job
from h3core.serve.inputs import KEYFRAME_ROLES, JobInputs, Limits, read_allowed, save_keyframe, allowed_file
from h3core.serve.metrics import render_metrics

PAGE_FILES = {"/": ("index.html", "text/html; charset=utf-8"), "/static/app.js": ("app.js", "text/javascript; charset=utf-8"),
              "/static/style.css": ("style.css", "text/css; charset=utf-8")}
OPEN_PATHS = {"/health", *PAGE_FILES}
PAGE_POLICY = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' blob:; media-src 'self' blob:; "
               "connect-src 'self'; form-action 'none'; frame-ancestors 'none'; base-uri 'none'")
UPLOAD_FIELDS = {"input_reference": "first", "keyframes[first]": "first", "keyframes[last]": "last"}
FORM_FIELDS = {"prompt", "model", "seconds", "size", "seed", "steps", "frames", "guidance", "negative_prompt", "loras"}
VARIANTS = {"video": ("video.mp4", "video/mp4"), "thumbnail": ("thumbnail.png", "image/png"), "spritesheet": ("preview.png", "image/png")}


class BodyTooLarge(Exception):
    pass


class BodyStalled(Exception):
    pass


class Guard:
    """Plain ASGI middleware: the bearer key and the body cap (module docstring)."""

    def __init__(self, app: Any, api_key: str | None, body_bytes: int, body_seconds: float = 30.0):
        self.app, self.api_key, self.body_bytes, self.body_seconds = app, api_key, body_bytes, body_seconds

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        if self.api_key is not None and scope["path"] not in OPEN_PATHS and not self._authorized(headers.get("authorization", "")):
            error = ApiError(401, "this server needs an API key: send Authorization: Bearer <key>", "invalid_api_key")
            return await _send_json(send, error.status, error.body(), {"www-authenticate": "Bearer"})
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.body_bytes:
            await _drain(receive, DRAIN_BYTES)  # so that a client still sending reads the 413, not a reset connection
            return await _send_json(send, 413, _too_large(self.body_bytes).body())
        seen, whole = 0, False

        async def counted() -> dict:
            nonlocal seen, whole
            if whole:  # after the body: the wait for a disconnect is not timed
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), self.body_seconds)
            except asyncio.TimeoutError:
                raise BodyStalled() from None
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                whole = not message.get("more_body", False)
                if seen > self.body_bytes:
                    raise BodyTooLarge(self.body_bytes)
            return message

        return await self.app(scope, counted, send)

    def _authorized(self, header: str) -> bool:
        scheme, _, token = header.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), (self.api_key or "").encode())


DRAIN_BYTES = 64 << 20
"""How much of a refused body is read (and dropped) before the 413 goes out; a larger one is cut off."""


async def _drain(receive: Any, limit: int) -> None:
    """Read and drop what a client sends of its body, up to `limit` bytes."""
    seen = 0
    while seen < limit:
        message = await receive()
        if message["type"] != "http.request":
            return
        seen += len(message.get("body", b""))
        if not message.get("more_body", False):
            return


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"the request body is larger than this server takes ({limit:,} bytes)", "request_too_large")


async def _send_json(send: Any, status: int, body: dict, extra: dict[str, str] | None = None) -> None:
    response = JSONResponse(body, status_code=status, headers=extra)
    await response({"type": "http"}, None, send)  # type: ignore[arg-type]


def build_app(state: ServerState) -> Any:
    """The application (wrapped in its `Guard`)."""
    app = FastAPI(title="h3 serve", version="1", docs_url=None, redoc_url=None,
                  description="The Videos API (OpenAI's shape) over h3's resident ranks; see docs/serve.md.")
    _errors(app)
    _page(app)
    _videos(app, state)
    _service(app, state)
    return Guard(app, state.job.api_key, state.job.limits.body_bytes, state.job.limits.body_seconds)


# -- errors ----------------------------------------------------------------------------------------------


def _errors(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers={"cache-control": "no-store"})

    @app.exception_handler(BodyTooLarge)
    async def too_large(request: Request, exc: BodyTooLarge) -> JSONResponse:
        return JSONResponse(_too_large(exc.args[0]).body(), status_code=413)

    @app.exception_handler(BodyStalled)
    async def stalled(request: Request, exc: BodyStalled) -> JSONResponse:
        error = ApiError(408, "the request body stopped arriving; send it again", "request_timeout")
        return JSONResponse(error.body(), status_code=408, headers={"connection": "close"})

    @app.exception_handler(sqlite3.Error)
    async def queue_failed(request: Request, exc: sqlite3.Error) -> JSONResponse:
        reason = " ".join(str(exc).split()) or type(exc).__name__
        print(f"h3 serve: the job queue failed on {request.method} {request.url.path}: {reason}", file=sys.stderr)
        error = ApiError(503, f"the server cannot use its job queue now ({reason}); nothing was kept: try again later", "queue_unavailable")
        return JSONResponse(error.body(), status_code=503)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        return JSONResponse(_validation_error(first).body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {400: "invalid_request", 404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        message = {404: f"no route {request.url.path}", 405: f"{request.method} is not allowed on {request.url.path}"}.get(exc.status_code, str(exc.detail))
        return JSONResponse(ApiError(exc.status_code, message, code).body(), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        if settings.debug():
            traceback.print_exception(exc, file=sys.stderr)
        else:
            print(f"h3 serve: internal error on {request.method} {request.url.path}: {type(exc).__name__}", file=sys.stderr)
        return JSONResponse(ApiError(500, "internal error in the server; its operator can see it with H3_DEBUG=1", "internal_error").body(), status_code=500)


def _validation_error(first: dict) -> ApiError:
    where = ".".join(str(p) for p in first.get("loc", ()) if p not in ("body", "query", "path"))
    return ApiError(400, f"{where + ': ' if where else ''}{first.get('msg', 'invalid value')}", "invalid_request", where or None)


# -- the page --------------------------------------------------------------------------------------------


def _page(app: FastAPI) -> None:
    files = resources.files("h3core.serve") / "static"

    def serve_file(path: str) -> Response:
        name, media = PAGE_FILES[path]
        headers = {"content-security-policy": PAGE_POLICY, "x-content-type-options": "nosniff", "cache-control": "no-cache",
                   "referrer-policy": "no-referrer"}
        return Response((files / name).read_bytes(), media_type=media, headers=headers)

    for path in PAGE_FILES:
        app.add_api_route(path, (lambda p=path: serve_file(p)), methods=["GET"], include_in_schema=False)


# -- the Videos API -----------------------------------------------------------------------------------------


def to_video(row: dict[str, Any]) -> Video:
    done = row["status"] in ("completed", "failed")
    return Video(
        id=row["id"], status=row["status"], created_at=int(row["created_at"]), completed_at=int(row["completed_at"]) if done and row["completed_at"] else None,
        model=row["model"], prompt=_prompt_of(row), progress=100 if row["status"] == "completed" else row["progress"], seconds=row["seconds"],
        size=row["size"], error=VideoError(code=row["error_code"], message=row["error_message"] or "") if row["error_code"] else None,
        seed=row["seed"], steps=row["steps"], frames=row["frames"], replica=row["replica"], attempts=row["attempts"],
    )


def _prompt_of(row: dict[str, Any]) -> str:
    return VideoCreate.model_validate_json(row["request"]).prompt


def _job_id(video_id: str) -> str:
    if not JOB_ID.match(video_id):
        raise not_found(video_id[:80])
    return video_id


def _videos(app: FastAPI, state: ServerState) -> None:
    queue = state.queue

    @app.post("/v1/videos", response_model=Video, summary="Create a video job (JSON or multipart/form-data)")
    async def create_video(request: Request) -> Video:
        if state.phase != "ok":
            raise ApiError(503, _not_ready(state), "server_" + state.phase, None)
        fields, uploads, strict = await _read_body(request, state)
        return await run_in_threadpool(_create, state, fields, uploads, strict)

    @app.get("/v1/videos", response_model=VideoList, summary="List jobs, newest first")
    def list_videos(limit: int = Query(20, ge=1, le=100), after: str | None = Query(None, max_length=80),
                    order: Literal["asc", "desc"] = "desc") -> VideoList:
        if after is not None and not JOB_ID.match(after):
            raise ApiError(400, f"after {after!r} is not a video id", "invalid_request", "after")
        page = queue.page(limit, after, newest_first=order == "desc")
        if page is None:
            raise not_found(after or "")
        rows, more = page
        data = [to_video(row) for row in rows]
        return VideoList(data=data, first_id=data[0].id if data else None, last_id=data[-1].id if data else None, has_more=more)

    @app.get("/v1/videos/{video_id}", response_model=Video, summary="A job: status, progress, error")
    def retrieve_video(video_id: str) -> Video:
        row = queue.get(_job_id(video_id))
        if row is None:
            raise not_found(video_id)
        return to_video(row)

    @app.get("/v1/videos/{video_id}/content", summary="The mp4 (variant=video), its first frame (thumbnail) or preview (spritesheet)",
             response_class=FileResponse, responses={200: {"content": {"video/mp4": {}, "image/png": {}}}})
    def video_content(video_id: str, variant: Literal["video", "thumbnail", "spritesheet"] = "video") -> FileResponse:
        row = queue.get(_job_id(video_id))
        if row is None:
            raise not_found(video_id)
        if row["status"] != "completed":
            raise ApiError(409, f"video {video_id} is {row['status']}, not completed: its content is not there", "video_not_ready")
        name, media = VARIANTS[variant]
        path = state.folder_of(video_id) / name
        if not path.is_file():
            raise ApiError(404, f"video {video_id} has no {variant} on this server", "content_not_found", "variant")
        return FileResponse(path, media_type=media, filename=f"{video_id}{Path(name).suffix}", content_disposition_type="inline",
                            headers={"x-content-type-options": "nosniff"})

    @app.delete("/v1/videos/{video_id}", response_model=VideoDeleted, summary="Delete a job: a running one stops at its next step")
    def delete_video(video_id: str) -> VideoDeleted:
        row = queue.delete(_job_id(video_id))
        if row is None:
            raise not_found(video_id)
        if row["status"] == "in_progress":
            state.cancel(video_id)  # its group stops at the next step; the engine removes what it had
        else:
            state.remove_files(video_id)
        return VideoDeleted(id=video_id)


def _not_ready(state: ServerState) -> str:
    return {"loading": "the model is loading; try again in a moment (GET /health says when it is ready)",
            "stopping": "the server is stopping and takes no new jobs",
            "failed": f"the server could not start its ranks: {state.message or 'see its log'}"}.get(state.phase, "the server is not ready")


async def _read_body(request: Request, state: ServerState) -> tuple[dict[str, Any], dict[str, bytes], bool]:
    """The request's fields and uploaded files (role -> bytes), from JSON or multipart/form-data, and
    whether its fields carry their own types (JSON: validated strictly)."""
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind == "application/json":
        return _json_object(await request.body(), "the body", 'send one JSON object, e.g. {"prompt": "a red fox"}'), {}, True
    if kind not in ("multipart/form-data", "application/x-www-form-urlencoded"):
        raise ApiError(400, f"send application/json or multipart/form-data, not {kind or 'no content type'}", "invalid_content_type")
    form = await request.form(max_files=3, max_fields=32, max_part_size=1 << 20)
    fields: dict[str, Any] = {}
    uploads: dict[str, bytes] = {}
    keyframes: dict[str, str] = {}
    for name, value in form.multi_items():
        if isinstance(value, UploadFile):
            if name not in UPLOAD_FIELDS:
                raise ApiError(400, f"unknown file field {name!r}; files go in input_reference, keyframes[first] or keyframes[last]", "invalid_request", name)
            role = UPLOAD_FIELDS[name]
            if role in uploads:
                raise ApiError(400, f"two images for the {role} keyframe (input_reference is the first keyframe)", "invalid_request", name)
            uploads[role] = await value.read(state.job.limits.image_bytes + 1)
        elif name in ("keyframes[first]", "keyframes[last]"):
            keyframes[name[10:-1]] = value
        elif name in FORM_FIELDS:
            fields[name] = _loras(value) if name == "loras" else value
        else:
            raise ApiError(400, f"unknown field {name!r}", "invalid_request", name)
    if keyframes:
        fields["keyframes"] = keyframes
    return fields, uploads, False


def _json_object(data: bytes | str, where: str, hint: str, want: type = dict) -> Any:
    """A JSON document of a request, read by h3's one JSON reader; a 400 naming `where` otherwise."""
    try:
        return parse_json(data, where, hint, want=want)
    except ConfigError as err:
        raise ApiError(400, str(err), "invalid_json") from None


def _loras(text: str) -> Any:
    return _json_object(text, "loras (a form field)", 'give a JSON list, e.g. [{"path": "/srv/loras/style.safetensors", "scale": 0.8}]', list)


def _create(state: ServerState, fields: dict[str, Any], uploads: dict[str, bytes], strict: bool = False) -> Video:
    """Check the request, save its inputs, resolve it as the engine will, queue it (the job object)."""
    job = state.job
    if isinstance(fields.get("seconds"), (int, float)) and not isinstance(fields.get("seconds"), bool):
        fields["seconds"] = f"{fields['seconds']:g}"
    try:
        create = VideoCreate.model_validate(fields, strict=strict)
    except ValidationError as err:
        raise _validation_error(err.errors()[0]) from None
    if create.seed is None:
        create = create.model_copy(update={"seed": secrets.randbelow(2**32)})  # drawn once: a re-run is the same job
    job_id = f"video_{secrets.token_hex(16)}"
    try:
        inputs = _save_inputs(state, job_id, create, uploads)
        run, _ = plan_job(job, create, inputs, within=lambda r: _check_cost(create, r.shape.steps, r.shape.frames, job.limits))
        s = run.shape
        row = {"id": job_id, "created_at": time.time(), "request": create.model_dump_json(), "inputs": inputs.model_dump_json(),
               "model": job.served_model, "size": f"{s.width}x{s.height}", "seconds": frames_seconds(s.frames), "steps": s.steps,
               "frames": s.frames, "seed": run.request.seed}
        if not state.queue.add(row, job.limits.queue):
            raise ApiError(429, f"the queue is full ({job.limits.queue} jobs wait); try again when some have run", "queue_full")
    except BaseException:
        state.remove_files(job_id)
        raise
    state.wake.set()
    return to_video({**row, "status": "queued", "progress": 0, "completed_at": None, "error_code": None, "error_message": None,
                     "replica": None, "attempts": 0})


def _check_cost(create: VideoCreate, steps: int, frames: int, limits: Limits) -> None:
    """What a request asks for itself within the server's caps (the server's own flags are not bound)."""
    if create.steps is not None and steps > limits.steps:
        raise ApiError(400, f"steps {steps} is more than this server runs for one request ({limits.steps}); ask for fewer", "invalid_request", "steps")
    if (create.frames is not None or create.seconds is not None) and frames > limits.frames:
        raise ApiError(400, f"{frames} frames ({frames_seconds(frames)} s) is more than this server makes for one request ({limits.frames}); "
                       "ask for a shorter clip", "invalid_request", "frames" if create.frames is not None else "seconds")


def _save_inputs(state: ServerState, job_id: str, create: VideoCreate, uploads: dict[str, bytes]) -> JobInputs:
    """Uploaded and server-local keyframes copied into the job's input folder; adapters checked."""
    job, folder = state.job, state.inputs_of(job_id)
    keyframes: dict[str, str] = {}
    named = {role: getattr(create.keyframes, role) for role in KEYFRAME_ROLES if create.keyframes and getattr(create.keyframes, role)}
    for role in KEYFRAME_ROLES:
        if role in uploads and role in named:
            raise ApiError(400, f"the {role} keyframe given twice (an upload and a path)", "invalid_request", f"keyframes[{role}]")
        if role in uploads:
            keyframes[role] = save_keyframe(folder, role, uploads[role], f"keyframes[{role}]" if role == "last" else "input_reference", job.limits)
        elif role in named:
            data = read_allowed(named[role], job.allow_paths, f"keyframes[{role}]", job.limits.image_bytes)
            keyframes[role] = save_keyframe(folder, role, data, f"keyframes[{role}]", job.limits)
    loras = [(str(allowed_file(lora.path, job.allow_paths, "loras", job.limits.lora_bytes)), lora.scale) for lora in create.loras or []]
    return JobInputs(keyframes=keyframes, loras=loras)


# -- health and metrics -----------------------------------------------------------------------------------


def _service(app: FastAPI, state: ServerState) -> None:
    @app.get("/health", response_model=Health, summary="Ready (200) or loading / stopping / failed (503); needs no key")
    def health() -> JSONResponse:
        counts = state.queue.counts()
        body = Health(status=state.phase if state.phase in ("ok", "loading", "stopping", "failed") else "loading",  # type: ignore[arg-type]
                      model=state.job.served_model, replicas=state.job.template.replicas, queued=counts["queued"],
                      in_progress=counts["in_progress"], running=len(state.running), message=None if state.phase == "ok" else _not_ready(state))
        return JSONResponse(body.model_dump(), status_code=200 if state.phase == "ok" else 503)

    @app.get("/metrics", response_class=PlainTextResponse, summary="Prometheus text: queue, jobs by status, step, denoise and decode time, memory")
    def metrics() -> PlainTextResponse:
        return PlainTextResponse(render_metrics(state), media_type="text/plain; version=0.0.4; charset=utf-8")
