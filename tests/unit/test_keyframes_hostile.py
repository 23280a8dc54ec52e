"""Hostile keyframe files (issue 36, the new surfaces): every path that is not a plain image file is
refused from its metadata without being opened, every file is bounded by its size before a byte is
read and by its header before a pixel is decoded, what Pillow's header parser refuses is the same one
line as a corrupt file, and the odd-but-valid files (animated, every EXIF orientation, palettes with
transparency bytes) give exactly the pixels diffusers' `load_image` gives, with no warning printed."""

from __future__ import annotations

import io
import os
import struct
import warnings
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from h3core.errors import ConfigError
from h3core.keyframes import KeyframeError, open_keyframe
from h3core.keyframes import images as keyframe_images
from h3core.keyframes.images import FRAMES, MAX_KEYFRAME_PIXELS


def _pixels(height: int, width: int, channels: int = 3, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (height, width, channels)).astype(np.uint8).squeeze()


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def _png_with(path: Path, *chunks: bytes) -> Path:
    """A valid 16x16 RGB PNG with `chunks` between its header and its pixels."""
    header = struct.pack(">IIBBBBB", 16, 16, 8, 2, 0, 0, 0)
    rows = b"".join(b"\x00" + bytes(48) for _ in range(16))
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header) + b"".join(chunks) + _chunk(b"IDAT", zlib.compress(rows)) + _chunk(b"IEND", b""))
    return path


def _refused(path, words: str) -> str:
    with pytest.raises(KeyframeError, match=words) as caught:
        open_keyframe(path)
    message = str(caught.value)
    assert "\n" not in message and isinstance(caught.value, ConfigError) and caught.value.exit_code == 2, message
    return message


def _reference(path: Path) -> np.ndarray:
    from diffusers.utils import load_image

    return np.asarray(load_image(str(path)))


# --- paths that are no image file: refused by what they are, never opened -------------------------------------


def test_special_files_are_refused_by_what_they_are(tmp_path):
    fifo = tmp_path / "pipe.png"
    os.mkfifo(fifo)
    to_zero = tmp_path / "zero.png"
    to_zero.symlink_to("/dev/zero")
    loop = tmp_path / "loop.png"
    loop.symlink_to(loop)
    (tmp_path / "folder.png").mkdir()
    cases = {
        fifo: "is a FIFO",  # opening it would block for ever
        Path("/dev/zero"): "is a character device",  # reading it would never end
        to_zero: "is a character device",
        loop: "is unreadable .*symbolic links",
        tmp_path / "folder.png": "is a folder",
        tmp_path / "absent.webp": "does not exist",
        Path(f"{tmp_path}/nul\x00byte.png"): "not a valid path \\(it holds a NUL byte\\)",
    }
    for path, words in cases.items():
        _refused(path, words)


@pytest.mark.parametrize("suffix", ["png", "jpg", "webp"])
def test_what_is_no_image_under_an_image_name_is_one_line(tmp_path, suffix):
    contents = {
        "empty": b"",
        "text": b"a shopping list\n",
        "random": np.random.default_rng(1).integers(0, 256, 4096).astype(np.uint8).tobytes(),
        "safetensors": struct.pack("<Q", 2) + b"{}",
        "riff": b"RIFF\x10\x00\x00\x00WEBPVP8 garbage!",
    }
    for name, data in contents.items():
        path = tmp_path / f"{name}.{suffix}"
        path.write_bytes(data)
        _refused(path, "is not an image Pillow can read|cannot be decoded")


def test_a_file_is_bounded_by_its_size_before_a_byte_is_read(tmp_path, monkeypatch):
    path = tmp_path / "frame.png"
    Image.fromarray(_pixels(32, 32)).save(path)
    opened = []
    monkeypatch.setattr(keyframe_images, "MAX_KEYFRAME_BYTES", path.stat().st_size - 1)
    monkeypatch.setattr(Image, "open", lambda *a, **k: opened.append(a))
    _refused(path, f"is {path.stat().st_size:,} bytes, more than the {path.stat().st_size - 1:,} a keyframe may be")
    assert opened == []
    monkeypatch.undo()
    assert open_keyframe(path).size == (32, 32)


# --- headers: bounded before decoding --------------------------------------------------------------------------


def test_chunks_that_inflate_past_pillows_limit_are_one_line(tmp_path):
    bomb = zlib.compress(b"\x00" * (64 << 20))  # 64 MiB inflated from some 64 KiB
    _refused(_png_with(tmp_path / "ztxt.png", _chunk(b"zTXt", b"comment\x00\x00" + bomb)), "cannot be decoded .*too large")
    _refused(_png_with(tmp_path / "iccp.png", _chunk(b"iCCP", b"icc\x00\x00" + bomb)), "cannot be decoded .*too large")
    _refused(_png_with(tmp_path / "itxt.png", _chunk(b"iTXt", b"k\x00\x01\x00\x00\x00" + bomb)), "cannot be decoded .*too large")
    assert open_keyframe(_png_with(tmp_path / "fine.png", _chunk(b"tEXt", b"k\x00small"))).size == (16, 16)


def _jpeg_claiming(width: int, height: int) -> bytes:
    out = io.BytesIO()
    Image.fromarray(_pixels(16, 16)).save(out, format="JPEG")
    data = bytearray(out.getvalue())
    frame = data.find(b"\xff\xc0")
    data[frame + 5:frame + 9] = struct.pack(">HH", height, width)
    return bytes(data)


def _webp_claiming(width: int, height: int) -> bytes:
    """A VP8X (extended) WebP whose canvas is `width x height` (24-bit sizes minus one)."""
    canvas = (width - 1).to_bytes(3, "little") + (height - 1).to_bytes(3, "little")
    vp8x = b"VP8X" + struct.pack("<I", 10) + b"\x00\x00\x00\x00" + canvas
    return b"RIFF" + struct.pack("<I", 4 + len(vp8x)) + b"WEBP" + vp8x


@pytest.mark.parametrize("make, suffix", [(_jpeg_claiming, "jpg"), (_webp_claiming, "webp")])
def test_every_format_is_refused_from_a_header_claiming_too_many_pixels(tmp_path, monkeypatch, make, suffix):
    paths = {tmp_path / f"{width}.{suffix}": make(width, height) for width, height in ((8193, 8192), (16000, 16000), (65000, 65000))}
    decoded = []
    monkeypatch.setattr(Image.Image, "load", lambda self: decoded.append(self))
    for path, data in paths.items():
        path.write_bytes(data)
        message = _refused(path, "more than 67,108,864 pixels.*refused before decoding|cannot be decoded")
        assert "refused before decoding" in message or suffix == "webp", message  # a bare VP8X: Pillow's WebP decoder reads ahead
    assert decoded == [] and 8193 * 8192 > MAX_KEYFRAME_PIXELS


# --- odd but valid files: the reference's pixels ---------------------------------------------------------------


def _animated(path: Path, fmt: str) -> Path:
    frames = [Image.fromarray(_pixels(48, 64, seed=s)) for s in range(3)]
    frames[0].save(path, format=fmt, save_all=True, append_images=frames[1:], lossless=True) if fmt == "WEBP" else \
        frames[0].save(path, format=fmt, save_all=True, append_images=frames[1:])
    return path


@pytest.mark.parametrize("fmt, suffix", [("PNG", "png"), ("WEBP", "webp")])
def test_an_animated_image_gives_its_first_frame_as_load_image_does(tmp_path, fmt, suffix):
    path = _animated(tmp_path / f"anim.{suffix}", fmt)
    image = open_keyframe(path)
    assert image.info[FRAMES] == 3
    np.testing.assert_array_equal(np.asarray(image), _reference(path))
    np.testing.assert_array_equal(np.asarray(image), _pixels(48, 64, seed=0))  # the first frame, losslessly
    _refused(_animated(tmp_path / "anim.gif", "GIF"), "is a GIF image")


@pytest.mark.parametrize("orientation", [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 99])
def test_every_exif_orientation_is_applied_as_load_image_applies_it(tmp_path, orientation):
    image = Image.fromarray(_pixels(40, 64, seed=orientation))
    exif = image.getexif()
    exif[0x0112] = orientation  # 0, 9 and 99 are no orientation: left as stored, as exif_transpose leaves them
    for suffix, options in (("jpg", {"quality": 95}), ("png", {}), ("webp", {"lossless": True})):
        path = tmp_path / f"o{orientation}.{suffix}"
        image.save(path, exif=exif, **options)
        opened = open_keyframe(path)
        np.testing.assert_array_equal(np.asarray(opened), _reference(path), err_msg=f"{orientation} {suffix}")
        swapped = orientation in (5, 6, 7, 8)
        assert opened.size == ((40, 64) if swapped else (64, 40)), (orientation, suffix)


def test_odd_modes_convert_silently_to_the_references_pixels(tmp_path):
    palette = Image.fromarray(_pixels(32, 32)).convert("P", palette=Image.Palette.ADAPTIVE, colors=8)
    files = {"P, transparency as bytes": tmp_path / "p_bytes.png", "1-bit WebP": tmp_path / "bilevel.webp",
             "LA WebP": tmp_path / "la.webp", "CMYK JPEG": tmp_path / "cmyk.jpg", "1x1": tmp_path / "dot.png"}
    palette.save(files["P, transparency as bytes"], transparency=bytes(range(8)))
    Image.fromarray(_pixels(32, 32, 1) > 127).save(files["1-bit WebP"], lossless=True)
    Image.fromarray(_pixels(32, 32, 2), "LA").save(files["LA WebP"], lossless=True)
    Image.fromarray(_pixels(32, 32, 4), "CMYK").save(files["CMYK JPEG"])
    Image.fromarray(_pixels(1, 1)[None, None]).save(files["1x1"])
    for name, path in files.items():
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # Pillow's advice would be printed on the user's terminal
            image = open_keyframe(path)
        np.testing.assert_array_equal(np.asarray(image), _reference(path), err_msg=name)
