"""Build a `Qwen3TextModel` from named tensors, whatever provides them (a `WeightSource`: a checkpoint
reader or the synthetic generator): one assembly path, so the synthetic encoder is the same module as a real one."""

from __future__ import annotations

import torch

from h3core.nvfp4.io import WeightSource
from h3core.text.config import Qwen3TextConfig
from h3core.text.model import Qwen3Attention, Qwen3Layer, Qwen3TextModel, RMSNorm, SwiGLU


def assemble(
    source: WeightSource,
    prefix: str,
    config: Qwen3TextConfig,
    *,
    layers: int,
    final_norm: bool,
    dtype: torch.dtype,
) -> Qwen3TextModel:
    """The embedding, the first `layers` decoder layers and (when `final_norm`) the final norm."""
    embed = source.tensor(f"{prefix}embed_tokens.weight")  # [V, D]
    blocks = [_layer(source, f"{prefix}layers.{i}.", config) for i in range(layers)]
    norm = RMSNorm(source.tensor(f"{prefix}norm.weight"), config.rms_norm_eps) if final_norm else None
    return Qwen3TextModel(
        embed, blocks, norm, head_dim=config.head_dim, rope_theta=config.rope_theta, dtype=dtype
    )


def _layer(source: WeightSource, layer: str, config: Qwen3TextConfig) -> Qwen3Layer:
    def norm(name: str) -> RMSNorm:
        return RMSNorm(source.tensor(f"{layer}{name}.weight"), config.rms_norm_eps)

    attention = Qwen3Attention(
        *(source.linear(f"{layer}self_attn.{name}") for name in ("q_proj", "k_proj", "v_proj", "o_proj")),
        norm("self_attn.q_norm"),
        norm("self_attn.k_norm"),
        num_heads=config.num_heads,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
    )
    mlp = SwiGLU(*(source.linear(f"{layer}mlp.{name}") for name in ("gate_proj", "up_proj", "down_proj")))
    return Qwen3Layer(norm("input_layernorm"), attention, norm("post_attention_layernorm"), mlp)
