"""The Videos API's models, as the official `openai` client speaks it (DESIGN.md §8), and its errors.

Every error a client sees is `{"error": {"message", "type", "code", "param"}}` with its HTTP status
(`ApiError`); the message is one line meant for the person who sent the request, never a traceback.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from h3core.generate.request import MAX_SEED
from h3core.lora.spec import LoraScale

JOB_ID = re.compile(r"^video_[0-9a-f]{32}$")
"""A job's id: `video_` and 32 hex digits. Nothing else is looked up, so no id can name a path."""
MAX_PROMPT_CHARS = 20_000
Status = Literal["queued", "in_progress", "completed", "failed"]


class ApiError(Exception):
    """An error answered to a client: HTTP `status`, OpenAI's `type` and `code`, one-line `message`."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error", 409: "invalid_request_error",
             413: "invalid_request_error", 422: "invalid_request_error", 429: "rate_limit_error", 503: "server_error", 500: "server_error"}

    def __init__(self, status: int, message: str, code: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, " ".join(message.split()), code, param

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "invalid_request_error"), "code": self.code, "param": self.param}}


def not_found(video_id: str) -> ApiError:
    return ApiError(404, f"no video with id {video_id!r}", "video_not_found", "video_id")


class KeyframePaths(BaseModel):
    """Server-local keyframe images (JSON requests; multipart sends `keyframes[first]` / `keyframes[last]`)."""

    model_config = ConfigDict(extra="forbid")
    first: str | None = Field(None, max_length=4096)
    last: str | None = Field(None, max_length=4096)


class LoraSpec(BaseModel):
    """One adapter: a server-local file under an allowed directory, and its scale."""

    model_config = ConfigDict(extra="forbid")
    path: str = Field(max_length=4096)
    scale: LoraScale = 1.0


class VideoCreate(BaseModel):
    """`POST /v1/videos`: OpenAI's fields, then h3's. What is left out takes the server's flags (a
    seed left out is drawn once when the job is made, so a job re-run after a crash is the same)."""

    model_config = ConfigDict(extra="forbid")
    prompt: str = Field(min_length=1, max_length=MAX_PROMPT_CHARS, description="What to generate.")
    model: str | None = Field(None, max_length=200, description="The served model's name (`GET /v1/models` is not served; the job object says it).")
    seconds: str | None = Field(None, max_length=16, description="Clip length in seconds, a number as text (OpenAI's form, e.g. \"4\"); 24 frames a second, snapped up to 17n+5 frames.")
    size: str | None = Field(None, pattern=r"^[0-9]{1,5}x[0-9]{1,5}$", description="\"WxH\" in pixels (snapped to the model's multiple).")
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    steps: int | None = Field(None, ge=2, le=10_000, description="Sigma points of the schedule (steps - 1 forwards).")
    frames: int | None = Field(None, ge=1, le=100_000, description="Video frames (instead of seconds).")
    guidance: float | None = Field(None, ge=0, le=100, allow_inf_nan=False, description="Classifier-free guidance, where the checkpoint supports it (1: off; at most 100).")
    negative_prompt: str | None = Field(None, max_length=MAX_PROMPT_CHARS)
    keyframes: KeyframePaths | None = Field(None, description="Server-local first/last keyframes (under a directory the operator allowed).")
    loras: list[LoraSpec] | None = Field(None, max_length=16, description="Adapters: server-local files (under an allowed directory) and scales.")


class VideoError(BaseModel):
    code: str
    message: str


class Video(BaseModel):
    """The job object (OpenAI's `Video`, plus h3's fields after `error`)."""

    id: str
    object: Literal["video"] = "video"
    status: Status
    created_at: int
    completed_at: int | None = None
    expires_at: int | None = None
    model: str
    prompt: str
    progress: int = Field(ge=0, le=100, description="From the real step count: steps done / steps x 99, 100 once video.mp4 is whole.")
    seconds: str
    size: str
    error: VideoError | None = None
    remixed_from_video_id: str | None = None
    seed: int | None = None
    steps: int | None = None
    frames: int | None = None
    replica: int | None = Field(None, description="The replica group that ran it.")
    attempts: int = Field(0, description="Times a worker took it (more than 1: a crash or a stop re-queued it).")


class VideoList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Video]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False


class VideoDeleted(BaseModel):
    id: str
    object: Literal["video.deleted"] = "video.deleted"
    deleted: bool = True


class Health(BaseModel):
    status: Literal["ok", "loading", "stopping", "failed"]
    model: str
    replicas: int
    queued: int
    in_progress: int
    running: int = Field(description="Jobs the ranks hold now (a deleted job counts until its group stopped it).")
    message: str | None = None
