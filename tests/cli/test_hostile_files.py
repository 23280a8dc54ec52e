"""`h3 generate` given hostile keyframes and adapters (issue 36, the new surfaces): one line, exit 2,
nothing written, before any rank starts, whatever the file is (a device, a FIFO, a header bomb, deep
metadata, an absurd scale)."""

from __future__ import annotations

import json
import os
import struct
import zlib

import pytest


@pytest.fixture(autouse=True)
def in_tmp(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)


def _png_with_text_bomb(path):
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    rows = b"".join(b"\x00" + bytes(3 * 64) for _ in range(64))
    header = chunk(b"IHDR", struct.pack(">IIBBBBB", 64, 64, 8, 2, 0, 0, 0))
    bomb = chunk(b"zTXt", b"c\x00\x00" + zlib.compress(b"\x00" * (64 << 20)))
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + header + bomb + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b""))
    return path


def _adapter(path, metadata=None):
    from h3core.lora.synthetic import write_synthetic_adapter
    from h3core.model.config import preset

    return write_synthetic_adapter(path, preset("tiny"), rank=4, metadata=metadata)


@pytest.mark.parametrize(
    "make, needle",
    [
        (lambda tmp: ["--keyframe", "first=/dev/zero"], "is a character device"),
        (lambda tmp: (os.mkfifo(tmp / "pipe.png"), ["--keyframe", f"last={tmp / 'pipe.png'}"])[1], "is a FIFO"),
        (lambda tmp: ["--keyframe", f"first={_png_with_text_bomb(tmp / 'bomb.png')}"], "cannot be decoded"),
        (lambda tmp: ["--lora", f"{_adapter(tmp / 'a.safetensors')}:1e9"], "is outside ±100"),
        (lambda tmp: ["--lora", "/dev/zero"], "is a character device, not a file"),
        (lambda tmp: ["--lora", str(_adapter(tmp / "deep.safetensors", {"lora_adapter_metadata": "[" * 5000 + "]" * 5000}))],
         "JSON nested deeper than 100 levels"),
        (lambda tmp: ["--lora", str(_adapter(tmp / "alpha.safetensors", {"lora_adapter_metadata": json.dumps({"r": 4, "lora_alpha": 1e9})}))],
         "outside ±100"),
    ],
    ids=["dev-zero", "fifo", "text-bomb", "scale", "lora-device", "deep-metadata", "absurd-alpha"],
)
def test_a_hostile_keyframe_or_adapter_is_one_line_and_writes_nothing(h3, tmp_path, make, needle):
    code, out, err = h3("generate", *make(tmp_path), "--output", str(tmp_path / "run"))
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in err and needle in lines[0], err
    assert out == "" and not (tmp_path / "run").exists()
