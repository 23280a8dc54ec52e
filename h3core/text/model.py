"""The Qwen3 decoder's text path, sequence-first and batch-free like the rest of h3.

    h = embed_tokens[ids]
    for each layer up to the output layer:
        h += o_proj(attn(rope(q_norm(q_proj(n))), rope(k_norm(k_proj(n))), v_proj(n)))
             with n = input_layernorm(h), causal GQA attention
        h += down_proj(silu(gate_proj(m)) * up_proj(m)),  m = post_attention_layernorm(h)

The final norm is never applied: H3 conditions on an intermediate layer's output, un-normed.

The arithmetic follows Hugging Face's `Qwen3Model` operation for operation (RMSNorm in float32
then cast back, RoPE tables in float32, `rotate_half` RoPE, softmax scale `head_dim ** -0.5`), so
that in float32 the two agree to rounding. Linears are any module mapping `[..., in] -> [..., out]`:
h3's `NVFP4Linear` for quantized checkpoints, `DenseLinear` (`h3core.nvfp4.linear`) for unquantized ones.

Positions are the 1-D token indices `0..L-1` for text. For Qwen3-VL that is exact for text-only
input: its interleaved multimodal RoPE gives each frequency slot one of three position streams
(time, height, width), and for text tokens all three streams equal the token index, so every slot
rotates by `index * inv_freq[slot]` -- the ordinary 1-D RoPE with the same base and head width.

With keyframes (`forward_presented`) the rows of a vision block's image tokens carry the vision
tower's merged features instead of embeddings and 3-axis positions (`multimodal_positions`): slot
j follows the height stream when j % 3 == 1 and j < 3 * sections[1], the width stream when
j % 3 == 2 and j < 3 * sections[2], time otherwise (interleaved; Qwen3-VL's sections [24, 20, 20]).
The deepstack features are added to the image rows after decoder layers 0, 1, ... (one per
feature) where a later layer reads them: `hidden_states[k]` is decoder layer k-1's own output, as
transformers records it, so a feature due after layer k-1 is not in it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """`weight * x / sqrt(mean(x^2) + eps)`, normalized in float32 and cast back first (as Qwen3)."""

    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.register_buffer("weight", weight)  # [D]
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., D]
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight.to(x.dtype) * normed.to(x.dtype)


def rope_tables(
    length: int, head_dim: int, theta: float, *, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """`cos, sin: [L, Dh]` for positions `0..L-1` (each frequency twice: halves, not pairs)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))  # [Dh/2]
    positions = torch.arange(length, device=device, dtype=torch.float)  # [L]
    freqs = positions[:, None] * inv_freq.to(device)[None, :]  # [L, Dh/2]
    angles = torch.cat((freqs, freqs), dim=-1)  # [L, Dh]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def mrope_tables(
    positions: torch.Tensor, head_dim: int, theta: float, sections: tuple[int, int, int], *, interleaved: bool, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """`cos, sin: [L, Dh]` for `positions: [3, L]` (time, height, width streams): each of the
    `Dh/2` frequency slots takes its stream's position (module docstring), then doubled as halves."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))  # [Dh/2]
    freqs = positions.float()[..., None] * inv_freq.to(positions.device)  # [3, L, Dh/2]
    stream = mrope_streams(head_dim // 2, sections, interleaved=interleaved).to(positions.device)  # [Dh/2] in 0..2
    chosen = freqs.gather(0, stream.expand(1, positions.shape[1], -1))[0]  # [L, Dh/2]
    angles = torch.cat((chosen, chosen), dim=-1)  # [L, Dh]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def mrope_streams(slots: int, sections: tuple[int, int, int], *, interleaved: bool) -> torch.Tensor:
    """`[slots]`: which position stream (0 time, 1 height, 2 width) each frequency slot follows."""
    if not interleaved:  # Qwen2-VL's layout: three runs
        return torch.tensor([0] * sections[0] + [1] * sections[1] + [2] * sections[2])
    stream = torch.zeros(slots, dtype=torch.long)
    stream[1 : 3 * sections[1] : 3] = 1
    stream[2 : 3 * sections[2] : 3] = 2
    return stream


def multimodal_positions(length: int, image_spans: list[range], grids: list[tuple[int, int, int]], merge: int) -> torch.Tensor:
    """`[3, L]` positions as transformers' `Qwen3VLModel.get_rope_index`: text tokens count on in all
    three streams; an image's tokens are (start + t, start + row, start + column) over its merged
    grid; the text after an image continues at start + max(rows, columns), one past its largest position."""
    runs, current, cursor = [], 0, 0
    for span, (frames, height, width) in zip(image_spans, grids):
        assert frames == 1 and span.start >= cursor, "images are one frame, their spans in order"
        runs.append(torch.arange(span.start - cursor).expand(3, -1) + current)
        current += span.start - cursor
        rows, cols = height // merge, width // merge
        assert len(span) == rows * cols, "an image's pad tokens are its merged patches"
        row, col = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
        runs.append(torch.stack([torch.zeros(rows * cols, dtype=torch.long), row.flatten(), col.flatten()]) + current)
        current += max(rows, cols)
        cursor = span.stop
    runs.append(torch.arange(length - cursor).expand(3, -1) + current)
    return torch.cat(runs, dim=1)


class VisualRows:
    """What keyframes put into the language model: the rows of the image tokens, the tower's merged
    features there (`embeds: [K, D]`), and the deepstack features added after layers 0, 1, ..."""

    def __init__(self, rows: torch.Tensor, embeds: torch.Tensor, deepstack: list[torch.Tensor]):
        self.rows, self.embeds, self.deepstack = rows, embeds, deepstack  # rows: [K] long

    def embed(self, h: torch.Tensor) -> torch.Tensor:  # h: [L, D]
        h = h.clone()
        h[self.rows] = self.embeds.to(h.dtype)
        return h

    def after_layer(self, h: torch.Tensor, index: int) -> torch.Tensor:
        """`h` after decoder layer `index` plus that layer's deepstack feature (if any) at the image rows."""
        if index >= len(self.deepstack):
            return h
        h = h.clone()
        h[self.rows] = h[self.rows] + self.deepstack[index].to(h.dtype)
        return h


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x: [L, H, Dh]` by `cos, sin: [L, Dh]` (rotate-half convention)."""
    first, second = x.chunk(2, dim=-1)
    rotated = torch.cat((-second, first), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class Qwen3Attention(nn.Module):
    """Causal GQA self-attention with per-head RMSNorm on q and k before RoPE."""

    def __init__(
        self,
        q_proj: nn.Module,
        k_proj: nn.Module,
        v_proj: nn.Module,
        o_proj: nn.Module,
        q_norm: RMSNorm,
        k_norm: RMSNorm,
        *,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
    ):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = q_proj, k_proj, v_proj, o_proj
        self.q_norm, self.k_norm = q_norm, k_norm
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        length = x.shape[0]  # x: [L, D]
        q = self.q_norm(self.q_proj(x).view(length, self.num_heads, self.head_dim))  # [L, H, Dh]
        k = self.k_norm(self.k_proj(x).view(length, self.num_kv_heads, self.head_dim))  # [L, Hkv, Dh]
        v = self.v_proj(x).view(length, self.num_kv_heads, self.head_dim)  # [L, Hkv, Dh]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        group = self.num_heads // self.num_kv_heads  # query heads served by one kv head
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # [L, H, Dh]
        # 4-D [1, H, L, Dh] views: SDPA's fused kernels take 4-D input only (3-D runs the math kernel)
        q4, k4, v4 = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q4, k4, v4, is_causal=True)[0]  # [H, L, Dh]
        return self.o_proj(out.transpose(0, 1).reshape(length, self.num_heads * self.head_dim))


class SwiGLU(nn.Module):
    """`down_proj(silu(gate_proj(x)) * up_proj(x))`."""

    def __init__(self, gate_proj: nn.Module, up_proj: nn.Module, down_proj: nn.Module):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = gate_proj, up_proj, down_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [L, D]
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Qwen3Layer(nn.Module):
    """One pre-norm decoder layer: attention then SwiGLU, each added to the residual stream."""

    def __init__(self, input_norm: RMSNorm, attention: Qwen3Attention, post_norm: RMSNorm, mlp: SwiGLU):
        super().__init__()
        self.input_norm, self.attention, self.post_norm, self.mlp = input_norm, attention, post_norm, mlp

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:  # h: [L, D]
        h = h + self.attention(self.input_norm(h), cos, sin)
        return h + self.mlp(self.post_norm(h))


class Qwen3TextModel(nn.Module):
    """Token ids -> the hidden states after `len(layers)` layers, un-normed (Hugging Face's
    `hidden_states[len(layers)]`; 0 layers: the token embedding)."""

    def __init__(
        self,
        embedding: nn.Module,
        layers: list[Qwen3Layer],
        *,
        head_dim: int,
        rope_theta: float,
        dtype: torch.dtype,
        mrope_section: tuple[int, int, int] | None = None,
        mrope_interleaved: bool = True,
    ):
        super().__init__()
        self.embedding = embedding  # token ids [L] -> float32 rows [L, D]
        self.layers = nn.ModuleList(layers)
        self.head_dim, self.rope_theta, self.dtype = head_dim, rope_theta, dtype
        self.mrope_section, self.mrope_interleaved = mrope_section, mrope_interleaved

    @torch.inference_mode()
    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:  # token_ids: [L] -> [L, D]
        return self.forward_embeddings(self.embedding(token_ids).to(self.dtype))

    @torch.inference_mode()
    def forward_embeddings(self, h: torch.Tensor) -> torch.Tensor:  # h: [L, D] -> [L, D]
        """The layers on given input rows, at positions 0..L-1."""
        cos, sin = rope_tables(h.shape[0], self.head_dim, self.rope_theta, dtype=self.dtype, device=h.device)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return h

    @torch.inference_mode()
    def forward_presented(self, token_ids: torch.Tensor, positions: torch.Tensor, visual: VisualRows) -> torch.Tensor:
        """A presentation with images: `token_ids: [L]`, `positions: [3, L]` -> `[L, D]` (module docstring)."""
        assert self.mrope_section is not None, "image tokens need the M-RoPE sections"
        h = visual.embed(self.embedding(token_ids).to(self.dtype))
        cos, sin = mrope_tables(
            positions.to(h.device), self.head_dim, self.rope_theta, self.mrope_section, interleaved=self.mrope_interleaved, dtype=self.dtype
        )
        for index, layer in enumerate(self.layers):
            if index > 0:
                h = visual.after_layer(h, index - 1)
            h = layer(h, cos, sin)
        return h
