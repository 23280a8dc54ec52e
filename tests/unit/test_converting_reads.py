"""A tensor read in another floating dtype is converted as it is read, through one reused staging
buffer (`SafetensorsReader._fill_converting`): bitwise the stored tensor `.to(dtype)`, whole or by
rows, across the buffer's boundaries, with `bytes_read` counting the stored bytes; a non-float pair
is read stored and then converted; the transformer loads to the CPU bitwise as before."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from h3core.files import safetensors as st
from h3core.files.safetensors import SafetensorsReader
from h3core.span import Span


@pytest.fixture
def stored(tmp_path, monkeypatch):
    monkeypatch.setattr(st, "STAGING_BYTES", 64)  # many pieces per tensor, and pieces across rows
    g = torch.Generator().manual_seed(0)
    tensors = {
        "bf16": (torch.randn(37, 11, generator=g) * 100).to(torch.bfloat16),
        "f32": torch.randn(5, 13, generator=g) * 1e3,
        "f16": torch.randn(9, generator=g).to(torch.float16),
        "u8": torch.randint(0, 255, (7, 3), generator=g, dtype=torch.uint8),
        "scalar": torch.tensor(1.5, dtype=torch.bfloat16),
    }
    save_file(tensors, tmp_path / "t.safetensors")
    return tensors, SafetensorsReader([tmp_path / "t.safetensors"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_a_converting_read_is_the_stored_tensor_converted(stored, dtype):
    tensors, reader = stored
    for name in ("bf16", "f32", "f16", "scalar"):
        got = reader.get(name, dtype)
        assert got.dtype == dtype and torch.equal(got, tensors[name].to(dtype)), name
    rows = [Span(3, 9), Span(20, 37), Span(0, 1)]
    expected = torch.cat([tensors["bf16"][r.start : r.stop] for r in rows]).to(dtype)
    assert torch.equal(reader.get_rows("bf16", rows, dtype), expected)


def test_bytes_read_count_what_is_stored_and_other_kinds_convert_after(stored):
    tensors, reader = stored
    reader.get("bf16", torch.float32)
    assert reader.bytes_read == tensors["bf16"].numel() * 2
    got = reader.get("u8", torch.float32)
    assert got.dtype == torch.float32 and torch.equal(got, tensors["u8"].float())
    assert reader.get("bf16").dtype == torch.bfloat16  # no dtype: as stored


def test_a_wrong_piece_offset_is_caught(stored, monkeypatch):
    """The mutation the staged copy must not make: each piece lands at its own place."""
    tensors, reader = stored
    real = SafetensorsReader._fill_converting

    def shifted(self, name, flat, dtype, reads):  # type: ignore[no-untyped-def]
        real(self, name, flat, dtype, [(offset + 2, at, length - 2) for offset, at, length in reads])

    monkeypatch.setattr(SafetensorsReader, "_fill_converting", shifted)
    assert not torch.equal(reader.get("bf16", torch.float32), tensors["bf16"].float())


def test_the_transformer_loads_to_the_cpu_as_before(tmp_path):
    """Every layout's dense weights through the converting read: the loaded fp32 model holds the
    stored bf16 values converted, and its NVFP4 tensors keep their formats."""
    from h3core.model.checkpoint import load_transformer
    from h3core.model.config import preset
    from h3core.model.synthetic import synthetic_checkpoint

    path = synthetic_checkpoint(preset("tiny"))[0]
    model = load_transformer(path)
    reader = SafetensorsReader([path])
    checked = 0
    for name, tensor in model.state_dict().items():
        if name in reader and reader.dtype(name) == torch.bfloat16 and tensor.dtype == torch.float32:
            assert torch.equal(tensor, reader.get(name).float()), name
            checked += 1
    assert checked > 0
