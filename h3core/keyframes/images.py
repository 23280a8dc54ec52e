"""Keyframe images: opened and checked, the canvas their aspect gives, and their preparation onto it.

    image = open_keyframe("start.png")              # RGB, EXIF-upright, checked before decoding
    width, height = canvas_for(image.size, short_edge=768, max_area=768 * 1344)
    keyframes = prepare_keyframes([("first", image)], width, height)   # [(role, RGB image at W x H)]

Opening follows what H3's references do with a file (diffusers' `load_image`, SGLang's
`minimax_h3/canvas.py`): `ImageOps.exif_transpose`, then `convert("RGB")`. So alpha is dropped (not
composited), CMYK, grayscale, bilevel and palette images take Pillow's conversion, a 16-bit RGB PNG
keeps its high bytes (Pillow decodes it so), and a 16-bit *grayscale* PNG (`I;16`) is clipped to
255 by that conversion, exactly as the references clip it (docs/keyframes.md). Before a pixel is
decoded the file must be a regular file of at most `MAX_KEYFRAME_BYTES`, and its header must say PNG,
JPEG or WebP, at most `MAX_KEYFRAME_PIXELS` pixels, and an aspect ratio within 1:4..4:1 (the ratios
MiniMax-H3 was trained over). An animated PNG or WebP gives its first frame, as the references'
`Image.open` does (`image.info[FRAMES]` says how many it had); an animated GIF is refused as a GIF.
Pillow's own limits on what its header parser inflates (text and ICC chunks past
`PngImagePlugin.MAX_TEXT_CHUNK`) are the same one line as a corrupt file, and its warnings about a
conversion (a palette's transparency given as bytes) are not printed: the conversion is the reference's.

The canvas and the preparation are diffusers 0.42.1's `resolve_canvas_size` and
`MiniMaxH3ResizeStep`: the first image in packed order (first, then last) is stretched onto the
canvas, a second one cover-scaled (sizes rounded) and centre-cropped, both with Pillow's LANCZOS;
an image already at the canvas size is kept as is. The same prepared pixels go to the vision tower
and to the video VAE.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Sequence

from PIL import Image, ImageOps, UnidentifiedImageError

from h3core.errors import KeyframeError
from h3core.files.paths import os_error_reason, path_kind

ROLES = ("first", "last")
"""Where a keyframe anchors the video, in packed order: the first frame, then the last."""

FORMATS = ("PNG", "JPEG", "WEBP")
"""The image formats a keyframe may be (what H3's server accepts)."""

MAX_KEYFRAME_PIXELS = 8192 * 8192
"""The most pixels a keyframe may have (67,108,864; checked from the header before decoding): 192 MiB
decoded as RGB, where the largest canvas is about a million pixels."""

MAX_KEYFRAME_BYTES = 256 << 20
"""The largest keyframe file opened (checked from its size before a byte is read): an 8192 x 8192 RGB
image stored uncompressed is 192 MiB. What Pillow's header parser holds in memory (ancillary chunks
it reads whole) is bounded by this."""

MIN_ASPECT, MAX_ASPECT = 1 / 4, 4.0
"""Width / height ratios MiniMax-H3 was trained over (diffusers' MINIMAX_H3_{MIN,MAX}_ASPECT_RATIO)."""

CANVAS_MULTIPLE = 32
"""Both canvas axes are multiples of this: the VAE's 16 x the transformer's 2 x 2 patch."""

SOURCE_MODE = "h3_source_mode"
"""`image.info` key of an opened keyframe: the Pillow mode of the file before the RGB conversion."""

FRAMES = "h3_source_frames"
"""`image.info` key of an opened keyframe: how many frames the file held (the first is the keyframe)."""

_DECODE_ERRORS = (OSError, SyntaxError, ValueError, EOFError, IndexError, MemoryError)
"""What Pillow raises on a truncated or corrupt image body (`image file is truncated`, broken chunks)."""


def open_keyframe(path: str | Path) -> Image.Image:
    """The keyframe at `path` as an upright RGB image, decoded only after its header passed every check."""
    path = Path(path)
    _check_file(path)
    with _open(path) as image:
        _check_header(image, path)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # Pillow's advice on a conversion that is the reference's own
                upright = ImageOps.exif_transpose(image)  # decodes (the first frame): after the checks
                rgb = upright.convert("RGB")
        except _DECODE_ERRORS as err:
            raise KeyframeError(_corrupt(path, f"{image.format} file", err)) from None
        rgb.info[SOURCE_MODE] = image.mode
        rgb.info[FRAMES] = getattr(image, "n_frames", 1)
    return rgb


def _check_file(path: Path) -> None:
    """A regular file of at most `MAX_KEYFRAME_BYTES`, told from its metadata (a FIFO is never opened)."""
    kind = path_kind(path, follow=True)
    if kind != "a file":
        what = "does not exist" if kind == "nothing" else f"is {kind}"
        raise KeyframeError(f"keyframe {path} {what}; pass the path of a PNG, JPEG or WebP image")
    size = path.stat().st_size
    if size > MAX_KEYFRAME_BYTES:
        raise KeyframeError(f"keyframe {path} is {size:,} bytes, more than the {MAX_KEYFRAME_BYTES:,} a keyframe may be; "
                            "save it smaller (a canvas is about a million pixels)")


def _open(path: Path) -> Image.Image:
    """The image with only its header read (Pillow decodes lazily)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # our own cap is lower and checked next
            return Image.open(path)
    except Image.DecompressionBombError:
        raise KeyframeError(_too_many_pixels(path, None)) from None
    except UnidentifiedImageError:
        raise KeyframeError(f"keyframe {path} is not an image Pillow can read; pass a PNG, JPEG or WebP image") from None
    except (SyntaxError, ValueError, EOFError) as err:  # a header Pillow parsed and refused (a text chunk past its limit)
        raise KeyframeError(_corrupt(path, "image", err)) from None
    except OSError as err:
        if err.errno is None:  # raised by a decoder that reads ahead (WebP), not by the file system
            raise KeyframeError(_corrupt(path, "image", err)) from None
        raise KeyframeError(f"keyframe {path} cannot be read: {os_error_reason(err)}") from None


def _check_header(image: Image.Image, path: Path) -> None:
    if image.format not in FORMATS:
        raise KeyframeError(f"keyframe {path} is a {image.format} image; h3 takes PNG, JPEG or WebP keyframes: convert it")
    width, height = image.size
    if width * height > MAX_KEYFRAME_PIXELS:
        raise KeyframeError(_too_many_pixels(path, image.size))
    check_aspect(image.size, f"keyframe {path}")


def _too_many_pixels(path: Path, size: tuple[int, int] | None) -> str:
    stated = f" ({size[0]}x{size[1]} = {size[0] * size[1]:,} pixels)" if size else ""
    return (
        f"keyframe {path} has more than {MAX_KEYFRAME_PIXELS:,} pixels{stated}, refused before decoding (a "
        "decompression bomb, or a photo far larger than any canvas); downscale it"
    )


def _corrupt(path: Path, what: str, err: BaseException) -> str:
    reason = " ".join(str(err).split()) or type(err).__name__
    return f"keyframe {path} cannot be decoded ({reason}): the {what} is truncated or corrupt; export the image again"


def check_aspect(size: tuple[int, int], what: str) -> None:
    """A `KeyframeError` unless `size`'s width / height is within 1:4..4:1."""
    width, height = size
    if width <= 0 or height <= 0:
        raise KeyframeError(f"{what} is {width}x{height}: an image needs a positive size")
    if not MIN_ASPECT <= width / height <= MAX_ASPECT:
        raise KeyframeError(
            f"{what} is {width}x{height}, an aspect ratio of {width / height:.3g}:1; MiniMax-H3 takes 1:4 to 4:1: "
            "crop it"
        )


def canvas_for(size: tuple[int, int], *, short_edge: int, max_area: int) -> tuple[int, int]:
    """`(W, H)`, multiples of 32, with the aspect of an image of `size` (width, height): the short edge
    at `short_edge`, the area then capped at `max_area`, each axis rounded to the nearest multiple
    (Python's `round`, so the area may end a little above the cap), as diffusers' canvas rule."""
    check_aspect(size, "the image setting the canvas")
    ratio = size[0] / size[1]
    if ratio >= 1.0:
        width, height = short_edge * ratio, float(short_edge)
    else:
        width, height = float(short_edge), short_edge / ratio
    area = width * height
    if area > max_area:
        scale = (max_area / area) ** 0.5
        width, height = width * scale, height * scale
    return _to_multiple(width), _to_multiple(height)


def _to_multiple(length: float) -> int:
    return max(CANVAS_MULTIPLE, round(length / CANVAS_MULTIPLE) * CANVAS_MULTIPLE)


def prepare_keyframes(images: Sequence[tuple[str, Image.Image]], width: int, height: int) -> list[tuple[str, Image.Image]]:
    """`(role, image)` pairs onto the `width x height` canvas, in packed order (first, then last): the
    first of them stretched, a second cover-scaled and centre-cropped (LANCZOS)."""
    ordered = sorted(_checked_roles(images), key=lambda pair: ROLES.index(pair[0]))
    canvas = (width, height)
    prepared = []
    for index, (role, image) in enumerate(ordered):
        image = image if image.mode == "RGB" else image.convert("RGB")
        if image.size != canvas:
            image = image.resize(canvas, Image.Resampling.LANCZOS) if index == 0 else _cover(image, canvas)
        prepared.append((role, image))
    return prepared


def _checked_roles(images: Sequence[tuple[str, Image.Image]]) -> list[tuple[str, Image.Image]]:
    roles = [role for role, _ in images]
    for role in roles:
        if role not in ROLES:
            raise KeyframeError(f"keyframe role {role!r} is not one of {', '.join(ROLES)}: say first=PATH and/or last=PATH")
    if len(set(roles)) != len(roles):
        repeated = next(role for role in roles if roles.count(role) > 1)
        raise KeyframeError(f"two keyframes for the {repeated} frame; give at most one first and one last")
    if not roles:
        raise KeyframeError("no keyframe given; give first=PATH and/or last=PATH")
    return list(images)


def _cover(image: Image.Image, canvas: tuple[int, int]) -> Image.Image:
    """Scaled to cover `canvas` (the larger ratio, sizes rounded), then its centre cropped out."""
    width, height = canvas
    scale = max(width / image.size[0], height / image.size[1])
    resized = (max(width, round(image.size[0] * scale)), max(height, round(image.size[1] * scale)))
    left, top = max(0, (resized[0] - width) // 2), max(0, (resized[1] - height) // 2)
    return image.resize(resized, Image.Resampling.LANCZOS).crop((left, top, left + width, top + height))
