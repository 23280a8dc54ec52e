"""Tensor names of the H3 transformer's layouts, and where each logical row of a fused tensor is stored.

h3's model uses the *original* names (the official MiniMax shards and every Comfy single file:
`blocks.N.attn.qkv_proj.weight`, `blocks.N.mlp.fc1.weight`, ...) with two row orders fixed:
`qkv_proj` stacked `[q_all; k_all; v_all]` and `fc1` `[gate; up]`. A layout stores some tensors
otherwise (../shared/MINIMAX_H3.md §1.2-1.3):

| layout | qkv rows | fc1 rows | names |
|---|---|---|---|
| Comfy single file | stacked | [gate; up] | original (optional `model.diffusion_model.` prefix) |
| official shards | per head `[q_h; k_h; v_h]` | [gate; up] | original |
| diffusers `transformer/` | three tensors `to_q`, `to_k`, `to_v` | `ff.net.0.proj` = [up; gate] | diffusers |

`Piece`s say which stored rows make each logical row range, so a reader (`h3core.checkpoints.file`)
can read any logical row span, a tensor-parallel rank's heads included, with one read per piece
and nothing more. The table of diffusers names is ours, written from the diffusers converter's
documented mapping (`loaders/single_file_utils.convert_minimax_h3_transformer_checkpoint_to_diffusers`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from h3core.span import Span

COMFY_PREFIX = "model.diffusion_model."
"""Some community single files put every key under this prefix; h3 strips it."""



@dataclass(frozen=True)
class Piece:
    """Logical rows `[start, stop)` of a tensor are rows `[offset, offset + stop - start)` of the stored `source`."""

    source: str
    start: int
    stop: int
    offset: int = 0


def whole(source: str, rows: int) -> list[Piece]:
    return [Piece(source, 0, rows, 0)]


def interleaved_qkv(source: str, heads: int, head_dim: int) -> list[Piece]:
    """The official shards' `qkv_proj` (per head `[q_h; k_h; v_h]`) as stacked `[q; k; v]` rows."""
    width = heads * head_dim
    return [Piece(source, third * width + h * head_dim, third * width + (h + 1) * head_dim, (3 * h + third) * head_dim)
            for third in range(3) for h in range(heads)]


def split_qkv(sources: tuple[str, str, str], width: int) -> list[Piece]:
    """diffusers' `to_q`, `to_k`, `to_v` as stacked `[q; k; v]` rows."""
    return [Piece(name, third * width, (third + 1) * width, 0) for third, name in enumerate(sources)]


def swapped_halves(source: str, ffn_dim: int) -> list[Piece]:
    """diffusers' `ff.net.0.proj` (`[up; gate]`) as `[gate; up]` rows."""
    return [Piece(source, 0, ffn_dim, ffn_dim), Piece(source, ffn_dim, 2 * ffn_dim, 0)]


def stored_rows(pieces: list[Piece], spans: list[Span]) -> list[tuple[str, Span]]:
    """The stored (tensor, rows) reads that give logical rows `spans`, in order (adjacent reads of one
    tensor merged)."""
    reads: list[tuple[str, Span]] = []
    for span in spans:
        for p in pieces:
            a, b = max(span.start, p.start), min(span.stop, p.stop)
            if a >= b:
                continue
            rows = Span(p.offset + a - p.start, p.offset + b - p.start)
            if reads and reads[-1][0] == p.source and reads[-1][1].stop == rows.start:
                reads[-1] = (p.source, Span(reads[-1][1].start, rows.stop))
            else:
                reads.append((p.source, rows))
    return reads


# --- diffusers names -----------------------------------------------------------------------------------

_FROM_DIFFUSERS = [
    (r"^transformer_blocks\.(\d+)\.", r"blocks.\1."),
    (r"^token_refiner\.refiner_blocks\.(\d+)\.", r"token_refiner.blocks.\1."),
    (r"^proj_in\.", "video_patch_proj."),
    (r"^audio_proj_in\.", "audio_patch_proj."),
    (r"^context_embedder\.", "condition_proj."),
    (r"^time_embedder\.linear_1\.", "time_embedder.proj_in."),
    (r"^time_embedder\.linear_2\.", "time_embedder.proj_out."),
    (r"^norm_out\.norm\.", "final_layer.norm."),
    (r"^norm_out\.linear\.", "final_layer.adaln_proj.linear."),
    (r"^proj_out\.", "final_layer.video_out."),
    (r"^audio_proj_out\.", "final_layer.audio_out."),
    (r"\.attn\.norm_q\.", ".attn.q_norm."),
    (r"\.attn\.norm_k\.", ".attn.k_norm."),
    (r"\.attn\.to_out\.0\.", ".attn.out_proj."),
    (r"\.ff\.net\.0\.proj\.", ".mlp.fc1."),
    (r"\.ff\.net\.2\.", ".mlp.fc2."),
]
_QKV = re.compile(r"^(.*)\.attn\.to_([qkv])\.weight$")


def from_diffusers(name: str) -> str:
    """The original name of a diffusers tensor name (`to_q/k/v` map to their fused `qkv_proj`)."""
    match = _QKV.match(name)
    if match:
        name = f"{match.group(1)}.attn.qkv_proj.weight"
    for pattern, replacement in _FROM_DIFFUSERS:
        name = re.sub(pattern, replacement, name)
    return name
