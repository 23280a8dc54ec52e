"""Qwen3-VL's vision tower: patches of the keyframes -> one language-model row per 2x2 patches, plus
the deepstack features the language model adds to those rows after its first layers.

    embeds, deepstack = tower(pixel_values, grids)   # [N/m², out], [[N/m², out]] * len(deepstack layers)

Operation for operation as transformers 5.24's `Qwen3VLVisionModel` (sequence-first, batch-free):

1. patch embedding: each patch's `C x T x P x P` values (an image repeated over T = 2 frames) times
   the Conv3d kernel, which with stride = kernel is a linear layer on the flattened patch;
2. plus the learned `[G*G, D]` position table (G = 48) resampled to the image's `h x w` patch grid
   bilinearly with aligned corners: each patch sums its 4 neighbouring table rows with weights
   `(1 - |src - tap|)`, src = index * (G - 1) / (n - 1) per axis, in float32;
3. `depth` pre-norm blocks (LayerNorm eps 1e-6): non-causal attention within each image, q and k
   rotated (in float32) by a 2-D RoPE whose first half of frequencies follows the patch row and
   second half its column (`head_dim / 4` frequencies of base `rope_theta` each, the halves then
   doubled as in rotate-half RoPE), then a GELU(tanh) MLP;
4. after block `deepstack_visual_indexes[k]`, deepstack merger k: the 2x2 patches of a token
   concatenated, LayerNorm over the concatenation, linear, GELU, linear;
5. the final merger: LayerNorm per patch, the 2x2 concatenated, linear, GELU, linear.

Patches arrive in the image processor's order, 2x2 blocks consecutive (`image_processor.py`), so
merging is a reshape and merged token r of an image is row r of its `(h/2, w/2)` grid, row-major:
the order of its `<|image_pad|>` tokens.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from h3core.text.config import Qwen3VisionConfig


class LayerNorm(nn.Module):
    """`F.layer_norm` with a stored weight and bias, cast to the input's dtype."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-6):
        super().__init__()
        self.register_buffer("weight", weight)  # [D]
        self.register_buffer("bias", bias)  # [D]
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., D]
        return F.layer_norm(x, self.weight.shape, self.weight.to(x.dtype), self.bias.to(x.dtype), self.eps)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


class VisionAttention(nn.Module):
    """Bidirectional attention within each image's patches, q and k under the 2-D RoPE."""

    def __init__(self, qkv: nn.Module, proj: nn.Module, *, num_heads: int):
        super().__init__()
        self.qkv, self.proj, self.num_heads = qkv, proj, num_heads

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: Sequence[int]) -> torch.Tensor:
        patches = x.shape[0]  # x: [N, D]; cos, sin: [N, Dh] float32
        q, k, v = self.qkv(x).reshape(patches, 3, self.num_heads, -1).permute(1, 0, 2, 3).unbind(0)  # [N, H, Dh] each
        q, k = (_rotate(t, cos, sin) for t in (q, k))
        scale = q.shape[-1] ** -0.5
        outputs = []
        for q_i, k_i, v_i in zip(*(t.split(list(lengths)) for t in (q, k, v))):  # one image at a time
            q4, k4, v4 = (t.transpose(0, 1).unsqueeze(0) for t in (q_i, k_i, v_i))  # [1, H, n, Dh]
            outputs.append(F.scaled_dot_product_attention(q4, k4, v4, scale=scale)[0].transpose(0, 1))  # [n, H, Dh]
        return self.proj(torch.cat(outputs).reshape(patches, -1))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on `x: [N, H, Dh]` in float32, back in x's dtype."""
    x32 = x.float()
    return (x32 * cos[:, None, :] + rotate_half(x32) * sin[:, None, :]).to(x.dtype)


class VisionMLP(nn.Module):
    def __init__(self, fc1: nn.Module, fc2: nn.Module, *, approximate: str):
        super().__init__()
        self.fc1, self.fc2, self.approximate = fc1, fc2, approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [N, D]
        return self.fc2(F.gelu(self.fc1(x), approximate=self.approximate))


class VisionBlock(nn.Module):
    def __init__(self, norm1: LayerNorm, attention: VisionAttention, norm2: LayerNorm, mlp: VisionMLP):
        super().__init__()
        self.norm1, self.attention, self.norm2, self.mlp = norm1, attention, norm2, mlp

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: Sequence[int]) -> torch.Tensor:
        x = x + self.attention(self.norm1(x), cos, sin, lengths)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """m x m patches -> one row of the language model's width. The final merger normalizes each patch
    before concatenating; a deepstack merger normalizes the concatenation (`after_shuffle`)."""

    def __init__(self, norm: LayerNorm, fc1: nn.Module, fc2: nn.Module, *, merged_width: int, after_shuffle: bool):
        super().__init__()
        self.norm, self.fc1, self.fc2 = norm, fc1, fc2
        self.merged_width, self.after_shuffle = merged_width, after_shuffle

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [N, D] -> [N / m², out]
        if self.after_shuffle:
            x = self.norm(x.reshape(-1, self.merged_width))
        else:
            x = self.norm(x).reshape(-1, self.merged_width)
        return self.fc2(F.gelu(self.fc1(x)))


class Qwen3VisionTower(nn.Module):
    """Patches of one or more images -> their merged rows and deepstack features (module docstring)."""

    def __init__(
        self,
        patch_embed: nn.Module,
        pos_embed: torch.Tensor,
        blocks: list[VisionBlock],
        merger: PatchMerger,
        deepstack_mergers: list[PatchMerger],
        *,
        config: Qwen3VisionConfig,
        dtype: torch.dtype,
    ):
        super().__init__()
        self.patch_embed = patch_embed  # [N, C*T*P*P] -> [N, D]
        self.register_buffer("pos_embed", pos_embed)  # [G*G, D]
        self.blocks = nn.ModuleList(blocks)
        self.merger, self.deepstack_mergers = merger, nn.ModuleList(deepstack_mergers)
        self.config, self.dtype = config, dtype

    @torch.inference_mode()
    def forward(self, pixel_values: torch.Tensor, grids: Sequence[tuple[int, int, int]]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        device = self.pos_embed.device
        x = self.patch_embed(pixel_values.to(device=device, dtype=self.dtype))  # [N, D]
        x = x + interpolated_positions(self.pos_embed, grids, self.config).to(x.dtype)
        cos, sin = vision_rope_tables(grids, self.config, device=device)  # [N, Dh] float32
        lengths = [h * w for t, h, w in grids for _ in range(t)]  # attention stays within a frame
        deepstack = []
        for index, block in enumerate(self.blocks):
            x = block(x, cos, sin, lengths)
            if index in self.config.deepstack_visual_indexes:
                merger = self.deepstack_mergers[self.config.deepstack_visual_indexes.index(index)]
                deepstack.append(merger(x))
        return self.merger(x), deepstack


def patch_coordinates(grids: Sequence[tuple[int, int, int]], merge: int, device: torch.device) -> torch.Tensor:
    """`[N, 2]` (row, column) of every patch in the processor's order: m x m blocks row-major, and
    row-major within a block; repeated for each of an image's t frames."""
    coordinates = []
    for t, h, w in grids:
        block_row, block_col, row, col = torch.meshgrid(
            *(torch.arange(n, device=device) for n in (h // merge, w // merge, merge, merge)), indexing="ij"
        )
        one = torch.stack([(block_row * merge + row).flatten(), (block_col * merge + col).flatten()], dim=-1)  # [h*w, 2]
        coordinates.append(one.repeat(t, 1))
    return torch.cat(coordinates)


def interpolated_positions(table: torch.Tensor, grids: Sequence[tuple[int, int, int]], config: Qwen3VisionConfig) -> torch.Tensor:
    """`[N, D]` float32: the learned `[G*G, D]` position table resampled bilinearly (aligned corners)
    to each image's patch grid, in the processor's patch order."""
    side = config.grid_side
    rows = []
    for t, h, w in grids:
        coordinates = patch_coordinates([(t, h, w)], config.spatial_merge_size, table.device)  # [n, 2]
        row_taps, row_weights = _axis_taps(coordinates[:, 0], h, side)  # [n, 2] each
        col_taps, col_weights = _axis_taps(coordinates[:, 1], w, side)
        taps = (row_taps[:, :, None] * side + col_taps[:, None, :]).reshape(-1, 4)  # [n, 4] table rows
        weights = (row_weights[:, :, None] * col_weights[:, None, :]).reshape(-1, 4)  # [n, 4] float32
        rows.append((table[taps] * weights[:, :, None]).sum(1))  # [n, D] float32
    return torch.cat(rows)


def _axis_taps(index: torch.Tensor, length: int, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The two table entries either side of each patch along one axis, and their linear weights."""
    source = index.float() * (side - 1) / max(length - 1, 1)  # [n]: aligned corners
    floor = torch.floor(source)
    offsets = torch.arange(2, device=index.device)  # the entry below and the one above
    taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)  # [n, 2]
    weights = (1 - (source[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)  # [n, 2]
    return taps, weights


def vision_rope_tables(
    grids: Sequence[tuple[int, int, int]], config: Qwen3VisionConfig, *, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """`cos, sin: [N, Dh]` float32: per patch, `head_dim / 4` frequencies times its row, then the same
    frequencies times its column, and that half repeated (rotate-half layout)."""
    quarter = config.head_dim // 2
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, quarter, 2, dtype=torch.float) / quarter))  # [Dh/4]
    coordinates = patch_coordinates(grids, config.spatial_merge_size, device)  # [N, 2]
    angles = coordinates[..., None].float() * inv_freq.to(device)  # [N, 2, Dh/4]
    half = angles.flatten(1)  # [N, Dh/2]: row frequencies, then column frequencies
    full = torch.cat((half, half), dim=-1)  # [N, Dh]
    return full.cos(), full.sin()
