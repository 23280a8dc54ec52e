"""The synthetic text encoder: the real Qwen3 module on a small random config with NVFP4 linears,
deterministic from a seed, for runs without a text-encoder checkpoint.

Its width is the denoiser's text width; everything else is kept small so that it builds in
milliseconds at width 64 and in well under a second at H3's 5120: 2 layers, 4 query heads and
2 key/value heads of width 16 (so GQA is exercised), a SwiGLU width of 64, a 256-entry vocabulary
(the byte-level tokenizer's). Its hidden states carry no meaning; every report says `synthetic`.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from h3core.errors import ConfigError
from h3core.nvfp4 import layout
from h3core.nvfp4.linear import NVFP4Linear
from h3core.text.checkpoint import expected_linear_shapes, expected_vector_shapes
from h3core.text.config import QWEN3_RMS_NORM_EPS, QWEN3_ROPE_THETA, Qwen3TextConfig
from h3core.text.tokenizer import ByteTokenizer

SYNTHETIC_PREFIX = "model."


def synthetic_config(hidden_size: int) -> Qwen3TextConfig:
    """The synthetic decoder's dimensions for a denoiser text width of `hidden_size`."""
    if hidden_size <= 0 or not layout.is_block_aligned(hidden_size):
        raise ConfigError(
            f"text width {hidden_size} is not a positive multiple of {layout.BLOCK_ELEMENTS}; the synthetic "
            "text encoder's NVFP4 linears need whole 16-element blocks"
        )
    return Qwen3TextConfig(
        vocab_size=ByteTokenizer.vocab_size,
        hidden_size=hidden_size,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        intermediate_size=64,
        rope_theta=QWEN3_ROPE_THETA,
        rms_norm_eps=QWEN3_RMS_NORM_EPS,
    )


class SyntheticWeights:
    """A `WeightSource` drawing every tensor from one seeded CPU generator, in request order
    (so the same seed and config give the same weights on any device)."""

    def __init__(self, config: Qwen3TextConfig, seed: int, device: torch.device):
        self.config = config
        self.device = device
        self.generator = torch.Generator().manual_seed(seed)
        self.vectors = {
            "embed_tokens.weight": (config.vocab_size, config.hidden_size),
            "norm.weight": (config.hidden_size,),
            **expected_vector_shapes(config),
        }
        self.linears = expected_linear_shapes(config)

    def _normal(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self.generator)

    def has(self, name: str) -> bool:
        return name.endswith(tuple(self.vectors))

    def tensor(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        shape = self.vectors[_suffix(name, self.vectors)]
        if name.endswith("embed_tokens.weight"):
            return self._normal(*shape).to(device=self.device, dtype=dtype)  # [V, D], unit variance like a trained table
        return (1.0 + 0.1 * self._normal(*shape)).to(device=self.device, dtype=dtype)  # norm gains near 1

    def linear(self, name: str, *, rows=None, columns=None) -> nn.Module:  # type: ignore[no-untyped-def]
        if rows is not None or columns is not None:
            raise ValueError("the synthetic text encoder is never sharded")
        out, inp = self.linears[_suffix(name, self.linears)]
        weight = self._normal(out, inp) / math.sqrt(inp)  # [out, in], variance-preserving
        return NVFP4Linear.from_float(weight).to(self.device)


def _suffix(name: str, known: dict[str, object]) -> str:
    """The longest known name `name` ends with (`...input_layernorm.weight` before `norm.weight`)."""
    matches = [key for key in known if name.endswith("." + key)]
    assert matches, f"synthetic weights have no shape for {name}"
    return max(matches, key=len)
