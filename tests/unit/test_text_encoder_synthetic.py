"""The synthetic text encoder: the same Qwen3 module on a small seeded config with NVFP4 linears."""

from __future__ import annotations

import time

import pytest
import torch

from h3core.errors import ConfigError
from h3core.nvfp4.linear import NVFP4Linear
from h3core.text import load_text_encoder, release_text_encoder
from h3core.text.model import Qwen3TextModel

PROMPT = "a red fox running through snow, wind noise"


def test_synthetic_encoder_shape_info_and_linears():
    started = time.perf_counter()
    encoder = load_text_encoder(None, hidden_size=64, seed=3)
    build_seconds = time.perf_counter() - started
    states = encoder.encode(PROMPT, max_tokens=64)
    assert states.shape == (len(PROMPT.encode()), 64) and states.dtype == torch.float32
    assert torch.isfinite(states).all() and states.std() > 0.1
    info = encoder.info
    assert (info.kind, info.path, info.tokenizer, info.linears) == ("synthetic", None, "byte-level", "nvfp4")
    assert (info.bytes_on_disk, info.bytes_read, info.hidden_size, info.output_layer) == (0, 0, 64, 2)
    model = encoder._model
    assert isinstance(model, Qwen3TextModel)
    assert sum(isinstance(m, NVFP4Linear) for m in model.modules()) == 2 * 7
    assert info.resident_bytes == sum(t.numel() * t.element_size() for t in model.buffers())
    print(f"synthetic encoder (hidden 64) built in {build_seconds * 1e3:.1f} ms")


def test_synthetic_encoder_is_deterministic_from_its_seed():
    first = load_text_encoder(None, hidden_size=64, seed=7).encode(PROMPT, 64)
    again = load_text_encoder(None, hidden_size=64, seed=7).encode(PROMPT, 64)
    other = load_text_encoder(None, hidden_size=64, seed=8).encode(PROMPT, 64)
    assert torch.equal(first, again)
    assert not torch.allclose(first, other)


def test_synthetic_encoder_truncates_to_max_tokens():
    encoder = load_text_encoder(None, hidden_size=64)
    full = encoder.encode(PROMPT, 64)
    torch.testing.assert_close(encoder.encode(PROMPT, 9), full[:9], rtol=1e-6, atol=1e-6)


def test_synthetic_encoder_at_h3_width_is_light():
    encoder = load_text_encoder(None, hidden_size=5120)
    assert encoder.encode("fox", 8).shape == (3, 5120)
    assert encoder.info.resident_bytes < 16 * 2**20
    release_text_encoder(encoder)


def test_synthetic_output_layer_zero_is_the_byte_embedding():
    encoder = load_text_encoder(None, hidden_size=64, output_layer=0)
    assert encoder.info.layers == 0
    ids = torch.tensor(list(b"fox"))
    assert torch.equal(encoder.encode("fox", 8), encoder._model.embed_tokens[ids].float())


def test_synthetic_width_must_be_whole_nvfp4_blocks():
    with pytest.raises(ConfigError, match="not a positive multiple of 16"):
        load_text_encoder(None, hidden_size=72)
