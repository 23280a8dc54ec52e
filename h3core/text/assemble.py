"""Build a `Qwen3TextModel` from an opened checkpoint (`TextWeights`): the token embedding (rows read
on demand) and the first `layers` decoder layers; and, for keyframes only, the `Qwen3VisionTower`.
The synthetic encoder is a file in the Comfy layout, so it goes through this same path."""

from __future__ import annotations

import torch

from h3core.text.checkpoint import expected_linear_shapes
from h3core.nvfp4.linear import DenseLinear
from h3core.text.config import Qwen3TextConfig, Qwen3VisionConfig, mrope_sections
from h3core.text.model import Qwen3Attention, Qwen3Layer, Qwen3TextModel, RMSNorm, SwiGLU
from h3core.text.vision import LayerNorm, PatchMerger, Qwen3VisionTower, VisionAttention, VisionBlock, VisionMLP
from h3core.text.weights import TextWeights


def assemble(source: TextWeights, prefix: str, config: Qwen3TextConfig, *, layers: int, dtype: torch.dtype) -> Qwen3TextModel:
    """The embedding and decoder layers `0 .. layers - 1`; nothing past them is read."""
    blocks = [_layer(source, f"{prefix}layers.{i}.", config) for i in range(layers)]
    return Qwen3TextModel(
        source.embedding(prefix), blocks, head_dim=config.head_dim, rope_theta=config.rope_theta, dtype=dtype,
        mrope_section=mrope_sections(config), mrope_interleaved=config.mrope_interleaved,
    )


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


def assemble_vision(source: TextWeights, prefix: str, config: Qwen3VisionConfig, *, dtype: torch.dtype) -> Qwen3VisionTower:
    """The whole vision tower under `prefix` (its tensors checked by `vision_checkpoint.check_vision_tensors`)."""

    def dense(name: str) -> DenseLinear:
        return DenseLinear(source.tensor(f"{prefix}{name}.weight"), source.tensor(f"{prefix}{name}.bias"))

    def norm(name: str) -> LayerNorm:
        return LayerNorm(source.tensor(f"{prefix}{name}.weight"), source.tensor(f"{prefix}{name}.bias"))

    approximate = "tanh" if config.hidden_act == "gelu_pytorch_tanh" else "none"
    blocks = [
        VisionBlock(
            norm(f"blocks.{i}.norm1"),
            VisionAttention(dense(f"blocks.{i}.attn.qkv"), dense(f"blocks.{i}.attn.proj"), num_heads=config.num_heads),
            norm(f"blocks.{i}.norm2"),
            VisionMLP(dense(f"blocks.{i}.mlp.linear_fc1"), dense(f"blocks.{i}.mlp.linear_fc2"), approximate=approximate),
        )
        for i in range(config.depth)
    ]
    merged = config.hidden_size * config.spatial_merge_size**2

    def merger(name: str, after_shuffle: bool) -> PatchMerger:
        return PatchMerger(norm(f"{name}.norm"), dense(f"{name}.linear_fc1"), dense(f"{name}.linear_fc2"), merged_width=merged, after_shuffle=after_shuffle)

    patch = source.tensor(f"{prefix}patch_embed.proj.weight")  # [D, C, T, P, P]: a Conv3d with stride = kernel
    patch_embed = DenseLinear(patch.reshape(patch.shape[0], -1), source.tensor(f"{prefix}patch_embed.proj.bias"))
    deepstack = [merger(f"deepstack_merger_list.{k}", True) for k in range(len(config.deepstack_visual_indexes))]
    return Qwen3VisionTower(
        patch_embed, source.tensor(f"{prefix}pos_embed.weight"), blocks, merger("merger", False), deepstack, config=config, dtype=dtype
    )
