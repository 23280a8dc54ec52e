"""A job's keyframe images: uploaded (`input_reference` = the first keyframe, `keyframes[first]`,
`keyframes[last]`) or named as server-local paths, and the adapters' files; checked, then copied
into the job's input folder (`<state-dir>/inputs/<job id>/`), so that a job run again after a crash
reads what it was given, whatever happened to the original since.

Caps: an image file is at most `Limits.image_bytes` and at most `MAX_IMAGE_PIXELS` pixels (read from
its header before a pixel is decoded), PNG, JPEG or WebP. A server-local path is taken only under a
directory the operator allowed (`--allow-path DIR`, resolved with its links: a link that leads out
is refused), and only a regular file; it is checked again once open (`_opened_allowed`: a link
swapped in after the check leads nowhere) and a keyframe is read from that same open file.
"""

from __future__ import annotations

import io
import os
import stat
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from pydantic import BaseModel, Field

from h3core.keyframes.images import MAX_KEYFRAME_PIXELS, ROLES
from h3core.serve.api import ApiError

MAX_IMAGE_PIXELS = MAX_KEYFRAME_PIXELS
"""The largest keyframe image taken (width x height), read from its header before decoding: the
keyframe reader's own cap (h3core.keyframes.images), one rule for a file and an upload."""
IMAGE_FORMATS = {"PNG": "png", "JPEG": "jpg", "WEBP": "webp"}
KEYFRAME_ROLES = ROLES


class Limits(BaseModel):
    """What one request may send (the server's flags)."""

    body_bytes: int = Field(32 << 20, description="A whole request body (multipart included).")
    image_bytes: int = Field(16 << 20, description="One keyframe image file.")
    lora_bytes: int = Field(4 << 30, description="One adapter file named by a server-local path.")
    queue: int = Field(64, description="Jobs queued (not yet running) at once; more is 429.")
    steps: int = Field(100, ge=2, description="The most sigma points a request may ask for (twice H3's official 50); the server's own --steps is not bound by it.")
    frames: int = Field(481, ge=1, description="The most frames a request may ask for (20 s at 24 fps, after snapping to 17n+5); the server's own --frames is not bound by it.")
    head_seconds: float = Field(10.0, gt=0, description="A client's time to send a request's line and headers, from connecting or from its previous response (slowloris).")
    body_seconds: float = Field(30.0, gt=0, description="The longest pause while a client sends a body; a stalled upload is a 408.")


class JobInputs(BaseModel):
    """What a job was given beyond its fields, as saved in its input folder."""

    keyframes: dict[str, str] = Field(default_factory=dict, description="role (first, last) -> the saved image.")
    loras: list[tuple[str, float]] = Field(default_factory=list, description="(server-local file, scale), checked under an allowed directory.")

    @property
    def empty(self) -> bool:
        return not self.keyframes and not self.loras


def check_image(data: bytes, what: str) -> str:
    """The image's file extension; a 400 for anything that is not a PNG, JPEG or WebP within the pixel cap."""
    from PIL import Image, UnidentifiedImageError

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # the cap below is lower, and a 400
            opened = Image.open(io.BytesIO(data))  # reads the header only
        with opened as image:
            width, height, kind = image.width, image.height, image.format
            if width * height > MAX_IMAGE_PIXELS:
                raise ApiError(400, f"{what} is {width}x{height} pixels; at most {MAX_IMAGE_PIXELS:,} pixels are taken: send a smaller image", "image_too_large", what)
            if kind not in IMAGE_FORMATS:
                raise ApiError(400, f"{what} is a {kind} image; send a PNG, JPEG or WebP", "invalid_image", what)
            image.verify()
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, EOFError, Image.DecompressionBombError):
        raise ApiError(400, f"{what} is not an image h3 can read; send a PNG, JPEG or WebP", "invalid_image", what) from None
    return IMAGE_FORMATS[kind]


def save_keyframe(folder: Path, role: str, data: bytes, what: str, limits: Limits) -> str:
    """Check an image and write it as `<folder>/<role>.<ext>`; its path."""
    if len(data) > limits.image_bytes:
        raise ApiError(413, f"{what} is {len(data):,} bytes; at most {limits.image_bytes:,} are taken", "image_too_large", what)
    extension = check_image(data, what)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{role}.{extension}"
    from h3core.files.atomic import write_atomic

    write_atomic(path, data)
    return str(path)


def allowed_file(text: str, allowed: list[Path], what: str, limit: int) -> Path:
    """A server-local path the operator allowed: absolute, under an `--allow-path` directory once
    every link is resolved, a regular file of at most `limit` bytes (`_opened_allowed`). A 400
    otherwise (the message never says whether a refused path exists)."""
    with _opened_allowed(text, allowed, what, limit) as (_, real):
        return real


def read_allowed(text: str, allowed: list[Path], what: str, limit: int) -> bytes:
    """The bytes of an allowed server-local file, read from the very file that was checked."""
    with _opened_allowed(text, allowed, what, limit) as (fd, _):
        chunks, total = [], 0
        while chunk := os.read(fd, min(1 << 20, limit + 1 - total)):
            chunks.append(chunk)
            total += len(chunk)
            if total > limit:
                raise ApiError(413, f"{what}: {text!r} is larger than {limit:,} bytes", "file_too_large", what)
    return b"".join(chunks)


@contextmanager
def _opened_allowed(text: str, allowed: list[Path], what: str, limit: int) -> Iterator[tuple[int, Path]]:
    """(descriptor, resolved path) of an allowed file, checked twice: by its resolved path before it
    is opened (so nothing outside, and no FIFO or device, is ever opened), and as the open file itself
    (what the descriptor names, its kind and size), so that a link swapped in between (`..`, a folder
    replaced by a symlink) cannot lead out."""
    if not allowed:
        raise ApiError(400, f"{what}: this server takes no server-local paths (its operator allows directories with --allow-path DIR); upload the file instead", "paths_not_allowed", what)
    refused = ApiError(400, f"{what}: {text[:300]!r} is not a file under a directory this server allows", "path_not_allowed", what)
    path = Path(text)
    if not path.is_absolute() or "\x00" in text:
        raise refused
    try:
        real = path.resolve(strict=True)
        if not _under(real, allowed) or not stat.S_ISREG(os.stat(real).st_mode):
            raise refused
        fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except (OSError, RuntimeError):
        raise refused from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or not _under(_opened_path(fd, real), allowed):
            raise refused
        if info.st_size > limit:
            raise ApiError(413, f"{what}: {text[:300]!r} is {info.st_size:,} bytes; at most {limit:,} are taken", "file_too_large", what)
        yield fd, real
    finally:
        os.close(fd)


def _under(path: Path, allowed: list[Path]) -> bool:
    return any(path.is_relative_to(root) for root in allowed)


def _opened_path(fd: int, fallback: Path) -> Path:
    """Where the open file `fd` is (Linux names it in /proc/self/fd), else `fallback`."""
    try:
        return Path(os.readlink(f"/proc/self/fd/{fd}"))
    except OSError:
        return fallback
