"""The text encoder on CUDA: same states as on the CPU (to the bf16 weight-only path's rounding: the
Comfy markers ask for full-precision matmul, so even Blackwell dequantizes), and
`release_text_encoder` hands every byte back before the denoiser's loop."""

from __future__ import annotations

import gc

import pytest
import torch

from h3core.nvfp4.linear import NVFP4Linear
from h3core.text import load_text_encoder, release_text_encoder

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

PROMPT = "a red fox running through snow, wind noise"


@pytest.mark.parametrize("hidden_size", [64, 5120])
def test_cuda_matches_cpu_and_release_frees_memory(hidden_size, monkeypatch, tmp_path):
    monkeypatch.setenv("H3_CACHE_DIR", str(tmp_path))
    expected = load_text_encoder(None, hidden_size=hidden_size, seed=5).encode(PROMPT)  # CPU, fp32
    gc.collect()
    torch.cuda.empty_cache()
    baseline = torch.cuda.memory_allocated()
    encoder = load_text_encoder(None, hidden_size=hidden_size, seed=5, device="cuda", dtype=torch.bfloat16)
    assert torch.cuda.memory_allocated() - baseline >= encoder.info.resident_bytes
    assert {m.path for m in encoder._model.modules() if isinstance(m, NVFP4Linear)} == {"cuda-dequant-bf16"}  # the markers' full-precision matmul
    states = encoder.encode(PROMPT)
    assert states.device.type == "cpu" and states.dtype == torch.float32
    error = float((states - expected).abs().max() / expected.abs().max())
    assert error < 5e-2, f"CUDA bf16 vs CPU fp32 relative error {error:.3g}"
    release_text_encoder(encoder)
    assert torch.cuda.memory_allocated() == baseline
