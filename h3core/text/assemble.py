"""Build a `Qwen3TextModel` from an opened checkpoint (`TextWeights`): the token embedding (rows read
on demand) and the first `layers` decoder layers. The synthetic encoder is a file in the Comfy
layout, so it goes through this same path."""

from __future__ import annotations

import torch

from h3core.text.checkpoint import expected_linear_shapes
from h3core.text.config import Qwen3TextConfig
from h3core.text.model import Qwen3Attention, Qwen3Layer, Qwen3TextModel, RMSNorm, SwiGLU
from h3core.text.weights import TextWeights


def assemble(source: TextWeights, prefix: str, config: Qwen3TextConfig, *, layers: int, dtype: torch.dtype) -> Qwen3TextModel:
    """The embedding and decoder layers `0 .. layers - 1`; nothing past them is read."""
    blocks = [_layer(source, f"{prefix}layers.{i}.", config) for i in range(layers)]
    return Qwen3TextModel(source.embedding(prefix), blocks, head_dim=config.head_dim, rope_theta=config.rope_theta, dtype=dtype)


def _layer(source: TextWeights, layer: str, config: Qwen3TextConfig) -> Qwen3Layer:
    shapes = expected_linear_shapes(config)

    def norm(name: str) -> RMSNorm:
        return RMSNorm(source.tensor(f"{layer}{name}.weight"), config.rms_norm_eps)

    def linear(name: str) -> torch.nn.Module:
        return source.linear(f"{layer}{name}", *shapes[name])

    attention = Qwen3Attention(
        *(linear(f"self_attn.{name}") for name in ("q_proj", "k_proj", "v_proj", "o_proj")),
        norm("self_attn.q_norm"),
        norm("self_attn.k_norm"),
        num_heads=config.num_heads,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
    )
    mlp = SwiGLU(*(linear(f"mlp.{name}") for name in ("gate_proj", "up_proj", "down_proj")))
    return Qwen3Layer(norm("input_layernorm"), attention, norm("post_attention_layernorm"), mlp)
