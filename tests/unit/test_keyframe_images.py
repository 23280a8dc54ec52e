"""Keyframe images: every refusal is one `KeyframeError` line decided from the header (a decompression
bomb is refused before a pixel is decoded), every Pillow mode is converted to the pixels diffusers'
`load_image` gives (EXIF rotation, alpha dropped, CMYK, 16-bit, grayscale, palette), and the canvas
and the preparation equal diffusers 0.42.1's `resolve_canvas_size` / `MiniMaxH3ResizeStep` run
themselves."""

from __future__ import annotations

import errno
import os
import struct
import zlib
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image

from h3core.errors import ConfigError
from h3core.keyframes import ROLES, KeyframeError, canvas_for, open_keyframe, prepare_keyframes
from h3core.keyframes.images import MAX_KEYFRAME_PIXELS, SOURCE_MODE


def _pixels(height: int, width: int, channels: int = 3, seed: int = 0, dtype=np.uint8) -> np.ndarray:
    high = 255 if dtype == np.uint8 else 65535
    return np.random.default_rng(seed).integers(0, high + 1, (height, width, channels)).astype(dtype).squeeze()


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def _png16_rgb(path: Path, pixels: np.ndarray) -> Path:
    """A 16-bit RGB PNG (Pillow cannot write one): IHDR bit depth 16, colour type 2."""
    height, width, _ = pixels.shape
    raw = b"".join(b"\x00" + row.astype(">u2").tobytes() for row in pixels)
    header = struct.pack(">IIBBBBB", width, height, 16, 2, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", header) + _png_chunk(b"IDAT", zlib.compress(raw)) + _png_chunk(b"IEND", b""))
    return path


def _png_header_only(path: Path, width: int, height: int) -> Path:
    """A PNG whose header claims `width x height` and whose body is a few bytes: a decompression bomb's shape."""
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", header) + _png_chunk(b"IDAT", zlib.compress(b"\x00" * 64)) + _png_chunk(b"IEND", b""))
    return path


def _reference(path: Path) -> np.ndarray:
    from diffusers.utils import load_image

    return np.asarray(load_image(str(path)))


# --- conversions: the pixels diffusers' load_image gives ----------------------------------------------


def _mode_files(folder: Path) -> dict[str, Path]:
    files = {}
    rgba = Image.fromarray(_pixels(48, 64, 4, seed=1), "RGBA")
    files["RGBA"] = folder / "rgba.png"
    rgba.save(files["RGBA"])
    files["LA"] = folder / "la.png"
    Image.fromarray(_pixels(48, 64, 2, seed=2), "LA").save(files["LA"])
    files["L"] = folder / "gray.jpg"
    Image.fromarray(_pixels(48, 64, 1, seed=3), "L").save(files["L"], quality=95)
    files["CMYK"] = folder / "cmyk.jpg"
    Image.fromarray(_pixels(48, 64, 4, seed=4), "CMYK").save(files["CMYK"], quality=95)
    palette = Image.fromarray(_pixels(48, 64, 3, seed=5)).convert("P", palette=Image.Palette.ADAPTIVE, colors=16)
    palette.info["transparency"] = 3
    files["P"] = folder / "palette.png"
    palette.save(files["P"], transparency=3)
    files["1"] = folder / "bilevel.png"
    Image.fromarray(_pixels(48, 64, 1, seed=6) > 127).save(files["1"])
    files["I;16"] = folder / "gray16.png"
    Image.fromarray(_pixels(48, 64, 1, seed=7, dtype=np.uint16)).save(files["I;16"])
    files["RGB;16"] = _png16_rgb(folder / "rgb16.png", _pixels(48, 64, 3, seed=8, dtype=np.uint16))
    files["WEBP"] = folder / "lossless.webp"
    Image.fromarray(_pixels(48, 64, 4, seed=9), "RGBA").save(files["WEBP"], lossless=True)
    rotated = Image.fromarray(_pixels(48, 64, 3, seed=10))
    exif = rotated.getexif()
    exif[0x0112] = 6  # Orientation: rotate 90 clockwise to display
    files["EXIF"] = folder / "rotated.jpg"
    rotated.save(files["EXIF"], exif=exif, quality=95)
    return files


def test_every_mode_converts_to_the_pixels_diffusers_load_image_gives(tmp_path):
    files = _mode_files(tmp_path)
    for name, path in files.items():
        image = open_keyframe(path)
        assert image.mode == "RGB", name
        np.testing.assert_array_equal(np.asarray(image), _reference(path), err_msg=name)
    assert open_keyframe(files["EXIF"]).size == (48, 64)  # upright: the EXIF rotation applied
    assert open_keyframe(files["RGBA"]).info[SOURCE_MODE] == "RGBA"
    assert open_keyframe(files["CMYK"]).info[SOURCE_MODE] == "CMYK"
    # what the reference's conversion does, pinned: alpha dropped (not composited), 16-bit grayscale clipped
    rgba = np.asarray(Image.open(files["RGBA"]))
    np.testing.assert_array_equal(np.asarray(open_keyframe(files["RGBA"])), rgba[..., :3])
    gray16 = np.asarray(Image.open(files["I;16"])).astype(np.int64)
    np.testing.assert_array_equal(np.asarray(open_keyframe(files["I;16"]))[..., 0], np.minimum(gray16, 255))


# --- refusals: one line each, before decoding ----------------------------------------------------------


def test_missing_folder_empty_and_non_image_paths_are_one_line(tmp_path):
    (tmp_path / "empty.png").write_bytes(b"")
    (tmp_path / "notes.png").write_text("not an image at all\n")
    cases = {
        tmp_path / "absent.png": "does not exist",
        tmp_path: "is a folder",
        tmp_path / "empty.png": "is not an image",
        tmp_path / "notes.png": "is not an image",
    }
    for path, words in cases.items():
        with pytest.raises(KeyframeError, match=words) as caught:
            open_keyframe(path)
        assert "\n" not in str(caught.value) and isinstance(caught.value, ConfigError) and caught.value.exit_code == 2


def test_other_formats_are_refused_by_name(tmp_path):
    for suffix, fmt in (("gif", "GIF"), ("bmp", "BMP"), ("tiff", "TIFF")):
        path = tmp_path / f"frame.{suffix}"
        Image.fromarray(_pixels(32, 32)).save(path)
        with pytest.raises(KeyframeError, match=f"is a {fmt} image; h3 takes PNG, JPEG or WebP"):
            open_keyframe(path)


def test_an_unreadable_file_is_one_line(tmp_path, monkeypatch):
    path = tmp_path / "locked.png"
    Image.fromarray(_pixels(32, 32)).save(path)
    path.chmod(0)
    if os.geteuid() == 0:  # root reads a file whatever its mode: the refusal the kernel would give, given
        monkeypatch.setattr(Image, "open", lambda *a, **k: (_ for _ in ()).throw(PermissionError(errno.EACCES, "Permission denied")))
    with pytest.raises(KeyframeError, match="locked.png cannot be read: ") as caught:
        open_keyframe(path)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP"])
def test_a_truncated_file_is_refused_when_decoded(tmp_path, fmt):
    path = tmp_path / f"frame.{fmt.lower()}"
    Image.fromarray(_pixels(256, 256)).save(path, format=fmt)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(KeyframeError, match="cannot be decoded .*truncated or corrupt") as caught:
        open_keyframe(path)
    assert "\n" not in str(caught.value)


def test_a_decompression_bomb_is_refused_from_its_header(tmp_path, monkeypatch):
    decoded = []
    monkeypatch.setattr(Image.Image, "load", lambda self: decoded.append(self) or None)
    side = int(MAX_KEYFRAME_PIXELS**0.5) + 1  # just over the cap, below Pillow's own error threshold
    with pytest.raises(KeyframeError, match=f"more than {MAX_KEYFRAME_PIXELS:,} pixels \\({side}x{side}"):
        open_keyframe(_png_header_only(tmp_path / "bomb.png", side, side))
    with pytest.raises(KeyframeError, match="more than .* pixels, refused before decoding"):
        open_keyframe(_png_header_only(tmp_path / "huge.png", 30_000, 30_000))  # past Pillow's own DecompressionBombError
    assert decoded == []  # not a pixel decoded
    monkeypatch.undo()
    fine = tmp_path / "fine.png"
    Image.fromarray(_pixels(64, 64)).save(fine)
    assert open_keyframe(fine).size == (64, 64)


def test_aspect_ratios_outside_one_to_four_are_refused(tmp_path):
    for width, height, ok in ((400, 100, True), (100, 400, True), (401, 100, False), (100, 401, False)):
        path = tmp_path / f"{width}x{height}.png"
        Image.fromarray(_pixels(height, width)).save(path)
        if ok:
            assert open_keyframe(path).size == (width, height)
        else:
            with pytest.raises(KeyframeError, match=f"is {width}x{height}, an aspect ratio of .*1:4 to 4:1"):
                open_keyframe(path)


# --- the canvas and the preparation: diffusers' own code as the reference -------------------------------

ASPECTS = [(16, 9), (9, 16), (4, 3), (3, 4), (1, 1), (21, 9), (4, 1), (1, 4), (864, 480), (1920, 1080),
           (333, 1000), (1000, 333), (1234, 567), (5, 7), (3000, 2001)]


def test_canvas_for_equals_diffusers_resolve_canvas_size():
    from diffusers.modular_pipelines.minimax_h3.modular_pipeline import resolve_canvas_size

    for short_edge, max_area in ((768, 768 * 1344), (480, 480 * 864), (256, 256 * 448)):
        for width, height in ASPECTS:
            expected_h, expected_w = resolve_canvas_size(width, height, 32, short_edge, max_area)
            assert canvas_for((width, height), short_edge=short_edge, max_area=max_area) == (expected_w, expected_h)
    table = {(16, 9): (1344, 768), (9, 16): (768, 1344), (4, 3): (1024, 768), (1, 1): (768, 768), (21, 9): (1536, 672)}
    for aspect, canvas in table.items():  # MINIMAX_H3.md 2.5
        assert canvas_for(aspect, short_edge=768, max_area=768 * 1344) == canvas
    with pytest.raises(KeyframeError, match="1:4 to 4:1"):
        canvas_for((500, 100), short_edge=768, max_area=768 * 1344)


def _diffusers_resize(first, last, height, width):
    from diffusers.image_processor import VaeImageProcessor
    from diffusers.modular_pipelines import PipelineState
    from diffusers.modular_pipelines.minimax_h3.before_encoder import MiniMaxH3ResizeStep

    components = SimpleNamespace(
        image_processor=VaeImageProcessor(vae_scale_factor=16), canvas_multiple=32,
        config=SimpleNamespace(canvas_short_edge=768, canvas_max_pixels=768 * 1344),
    )
    state = PipelineState()
    for name, value in (("image", first), ("last_image", last), ("height", height), ("width", width)):
        state.set(name, value)
    _, state = MiniMaxH3ResizeStep()(components, state)
    return state.get("width"), state.get("height"), list(zip(state.get("keyframe_anchors"), state.get("keyframes")))


@pytest.mark.parametrize("sizes", [((500, 300), None), (None, (300, 500)), ((500, 300), (300, 400)), ((640, 360), (1280, 720)),
                                   ((1024, 768), (999, 1001)), ((1344, 768), (1344, 768))])
def test_prepare_keyframes_equals_diffusers_resize_step(sizes):
    images = {role: Image.fromarray(_pixels(size[1], size[0], seed=i)) for i, (role, size) in enumerate(zip(ROLES, sizes)) if size}
    given = list(images.items())[::-1]  # handed over last-first: the packed order does not depend on it
    for canvas in (None, (864, 480), (480, 864)):
        width, height, expected = _diffusers_resize(images.get("first"), images.get("last"), *(canvas[::-1] if canvas else (None, None)))
        if canvas is None:
            anchor = next(iter(sorted(images.items(), key=lambda pair: ROLES.index(pair[0]))))[1]
            assert (width, height) == canvas_for(anchor.size, short_edge=768, max_area=768 * 1344)
        prepared = prepare_keyframes(given, width, height)
        assert [role for role, _ in prepared] == [role for role, _ in expected]
        for (_, ours), (_, theirs) in zip(prepared, expected):
            assert ours.size == (width, height)
            np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))


def test_roles_are_checked():
    image = Image.fromarray(_pixels(32, 32))
    with pytest.raises(KeyframeError, match="role 'middle' is not one of first, last"):
        prepare_keyframes([("middle", image)], 64, 64)
    with pytest.raises(KeyframeError, match="two keyframes for the first frame"):
        prepare_keyframes([("first", image), ("first", image)], 64, 64)
    with pytest.raises(KeyframeError, match="no keyframe given"):
        prepare_keyframes([], 64, 64)
