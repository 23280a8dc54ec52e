"""The MiniMax-H3 transformer (../shared/MINIMAX_H3.md §1), h3's own implementation, with no parallelism.

It works on "some rows of a packed sequence": a `PackedSequence` says which segments those rows
hold (`text | audio | video`, local coordinates, each with its AdaLN tag and clock) and carries the
RoPE table of the whole sequence with the rows it covers. On one rank the rows are the whole
sequence; a parallel plan (h3core.parallel) feeds each rank its rows and reshapes modules from outside.

Per forward (diffusers 0.42.1 `MiniMaxH3Transformer3DModel` is the specification; `forward` also
takes its argument names, see `forward_diffusers`):

    text   = final_norm(refiner(condition_proj(states)))           once per request (`refine_text`)
    x      = [text rows | video_patch_proj(video rows) | audio_patch_proj(audio rows)]   in packed order
    cond   = full:   time_embedder(sinusoid_cos_first(t))           [M, 2688] fp32
             pruned: lerp(adaln_t_table, t * 1024)                  [M, 8]    fp32
    block: mod = adaln_proj(cond) -> [M * 3, 6, D]: row tidx * 3 + tag; shift, scale, gate (msa), (mlp)
           x += gate_msa * out_proj(SDPA(rope(q_norm(q)), rope(k_norm(k)), v)),  q|k|v = qkv_proj(RMS(x)*(1+scale)+shift)
           x += gate_mlp * fc2(silu(g) * u),                                     g|u = fc1(RMS(x)*(1+scale)+shift)
    out:   RMS(x) * (1 + scale[tidx]) + shift[tidx] -> fp32 -> video_out / audio_out

Numerics (§1.6): the patch projections, the timestep path and the output heads are float32 (and,
pruned, the AdaLN projections); everything else runs in the stream dtype (bf16 on a GPU, float32 on
the CPU by default). The full variant's SiLU(e) is taken in float32 and then cast to the AdaLN
projection's dtype, as the reference does.

Linears are `DenseLinear` or `NVFP4Linear` slots that the loader fills from the checkpoint
(`h3core.model.checkpoint`); which block linears tensor mode splits, and how, the model declares
(`TENSOR_PARALLEL`).
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from dataclasses import dataclass
from enum import Enum

import torch
import torch.nn as nn
import torch.nn.functional as F

from h3core.model.attention import attend
from h3core.model.inputs import (  # noqa: F401 - the model's inputs, importable from here too
    Clocks,
    PackedSequence,
    Rope,
    pack_audio,
    patchify_video,
    rope_inv_freq,
    rope_table,
    unpack_audio,
    unpatchify_video,
)
from h3core.model.config import ModelConfig
from h3core.model.packing import diffusers_sequence
from h3core.model.sequence import MODALITIES, Segment, SegmentKind
from h3core.nvfp4.linear import DenseLinear, NVFP4Linear

Linear = DenseLinear | NVFP4Linear

# --- RoPE -----------------------------------------------------------------------------------------


# --- positions -----------------------------------------------------------------------------------


ROPE_CHUNK_BYTES = 1 << 20
"""On the CPU, RoPE over more than 4 x this many bytes of input runs over row chunks of about this
size, so that its passes stay in cache instead of each streaming the whole activation through
memory (docs/performance.md). Smaller inputs, and every input on a GPU, run in one pass."""


def rope_chunk_rows(x: torch.Tensor) -> int:
    """Rows of x that `apply_rope` takes per pass: every row on a GPU or for a small x, else ~ROPE_CHUNK_BYTES."""
    rows = x.shape[0]
    row_bytes = x.element_size() * math.prod(x.shape[1:])
    if x.device.type != "cpu" or rows * row_bytes <= 4 * ROPE_CHUNK_BYTES:
        return max(rows, 1)
    return max(1, ROPE_CHUNK_BYTES // max(row_bytes, 1))


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Partial rotate-half RoPE. x: [S, *heads, Dh]; cos, sin: [S, R/2] -> rotates channels [0, R), keeps the rest.

    `out[:R] = x[:R] * [cos, cos] + [-x2, x1] * [sin, sin]` (pairs `i, i + R/2`) in x's dtype with
    cos and sin cast to it: the reference's products and sum, so the same bits. With `out` (x's
    shape, any strides) the result is written there (what lets Ulysses attention skip its pack copy).
    Every element is computed alone, so row chunks (`rope_chunk_rows`) give the same bits as one pass.
    """
    step = rope_chunk_rows(x)
    if step >= x.shape[0]:
        return _rope_rows(x, cos, sin, out)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device) if out is None else out
    for first in range(0, x.shape[0], step):
        rows = slice(first, first + step)
        _rope_rows(x[rows], cos[rows], sin[rows], out[rows])
    return out


def _rope_rows(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """`apply_rope` in one pass over x's rows (see there)."""
    half = cos.shape[-1]
    rotary = 2 * half
    broadcast = (cos.shape[0],) + (1,) * (x.dim() - 2) + (half,)  # [S, 1.., R/2]
    c, s = cos.to(x.dtype).reshape(broadcast), sin.to(x.dtype).reshape(broadcast)
    cos2, sin2 = torch.cat([c, c], dim=-1), torch.cat([-s, s], dim=-1)  # [S, 1.., R]
    xr = x[..., :rotary]
    rotated = torch.cat([xr[..., half:], xr[..., :half]], dim=-1).mul_(sin2)  # [x2, x1] * [-sin, sin] = [-x2, x1] * sin
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    torch.add(torch.mul(xr, cos2), rotated, out=out[..., :rotary])
    if rotary < x.shape[-1]:
        out[..., rotary:].copy_(x[..., rotary:])
    return out


# --- timesteps -------------------------------------------------------------------------------------


def sinusoid(t: torch.Tensor, channels: int) -> torch.Tensor:
    """`[cos(t f), sin(t f)]` with `f_i = 10000 ** (-i / (channels / 2))`, float32: t [M] -> [M, channels]
    (diffusers' `Timesteps(flip_sin_to_cos=True, downscale_freq_shift=0)`, same operations in order)."""
    half = channels // 2
    exponent = -math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=t.device) / half
    args = t.float()[:, None] * torch.exp(exponent)[None]
    return torch.cat([args.cos(), args.sin()], dim=-1)


def curve(table: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """The pruned variant's timestep features: `table` `[G, E]` read at `clamp(t, 0, 1) * (G - 1)`,
    linearly between the two nearest rows (ComfyUI's `torch.lerp`): t [M] -> [M, E] float32."""
    position = t.float().clamp(0.0, 1.0) * (table.shape[0] - 1)
    lower = position.floor().long().clamp(max=table.shape[0] - 2)
    return torch.lerp(table[lower], table[lower + 1], (position - lower).unsqueeze(1))


# --- layers --------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    """RMSNorm with a learned weight (`torch.nn.functional.rms_norm`, as the reference's `nn.RMSNorm`)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.register_buffer("weight", torch.empty(dim, device="meta"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def linear_slot(out_features: int, in_features: int, bias: bool) -> DenseLinear:
    """A linear of the right shape on the meta device; the loader replaces it with the checkpoint's
    (dense or NVFP4) linear."""
    weight = torch.empty(out_features, in_features, device="meta")
    return DenseLinear(weight, torch.empty(out_features, device="meta") if bias else None)


def io_dtype(linear: nn.Module, default: torch.dtype) -> torch.dtype:
    """The dtype a linear computes in: a dense weight's own dtype, else `default` (NVFP4 follows its input)."""
    return linear.weight.dtype if isinstance(linear, DenseLinear) else default


def modulate(x: torch.Tensor, segments: list[Segment], rows: list[int], shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Per segment `x * (1 + scale[row]) + shift[row]`. x: [S, D]; shift, scale: [M * 3, D]."""
    out = torch.empty_like(x)
    for seg, row in zip(segments, rows):
        out[seg.start : seg.stop] = x[seg.start : seg.stop] * (1.0 + scale[row]) + shift[row]
    return out


def add_gated(x: torch.Tensor, y: torch.Tensor, segments: list[Segment], rows: list[int], gate: torch.Tensor) -> torch.Tensor:
    """Per segment residual `x + gate[row] * y` (the gate raw: no tanh, no 1 +), in place. x, y: [S, D]."""
    for seg, row in zip(segments, rows):
        x[seg.start : seg.stop] += gate[row] * y[seg.start : seg.stop]
    return x


@dataclass(frozen=True)
class LinearHeads:
    """Heads of a linear's output not computed yet: features `[first, first + H * Dh)` of
    `linear(h)`, as [S, H, Dh]. `compute()` gives them as a new tensor; `into()` lets the GEMM write
    a range of heads straight into a destination laid out differently (no copy on the dequant paths)."""

    linear: NVFP4Linear
    h: torch.Tensor  # [S, D_in], the linear's input rows
    first: int  # first output feature of head 0
    num_heads: int
    head_dim: int

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.h.shape[0], self.num_heads, self.head_dim)

    def _features(self, first_head: int, count: int) -> slice:
        start = self.first + first_head * self.head_dim
        return slice(start, start + count * self.head_dim)

    def compute(self) -> torch.Tensor:
        return self.linear.forward_rows(self.h, self._features(0, self.num_heads)).unflatten(-1, (-1, self.head_dim))

    def into(self, heads: slice, out: torch.Tensor) -> None:
        """Heads `heads` into out: [S, *group, w, Dh], any strides, heads grouped as `(*group, w)`
        (e.g. `(peers, heads_per_peer)`). One GEMM per group of w heads, into its `[S, w * Dh]` view."""
        width, start = out.shape[-2], heads.start
        for index in itertools.product(*(range(n) for n in out.shape[1:-2])):
            dest = out[(slice(None), *index)]  # [S, w, Dh]
            rows = self._features(start, width)
            if dest.stride(-1) == 1 and dest.stride(-2) == self.head_dim:
                self.linear.forward_rows(self.h, rows, out=dest.view(dest.shape[0], width * self.head_dim))
            else:  # heads not laid out row by row: no matrix view of them exists
                dest.copy_(self.linear.forward_rows(self.h, rows).unflatten(-1, (width, self.head_dim)))
            start += width


@dataclass
class ProjectedQKV:
    """Attention inputs of some rows one step before they are final: q and k normalised, not yet
    rotated; v a tensor, or `LinearHeads` still to be computed. `cos`/`sin` None: no RoPE (the refiner).

    `split()` finishes them into q, k, v: [S, H, Dh] each, what a rank attends over. `write(heads,
    out)` writes the same values for a range of heads into a destination laid out differently, e.g.
    an all-to-all's send buffer, so that nothing is copied on the way out.
    """

    q: torch.Tensor  # [S, H, Dh], RMS-normalised
    k: torch.Tensor  # [S, H, Dh], RMS-normalised
    v: torch.Tensor | LinearHeads  # [S, H, Dh]
    cos: torch.Tensor | None  # [S, R/2]
    sin: torch.Tensor | None

    def _rope(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        if self.cos is None:
            return x if out is None else out.copy_(x)
        return apply_rope(x, self.cos, self.sin, out=out)

    def split(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        v = self.v.compute() if isinstance(self.v, LinearHeads) else self.v
        return self._rope(self.q), self._rope(self.k), v

    def write(self, heads: slice, out: torch.Tensor) -> None:
        """Heads `heads` of q, k (rotated) and v into out: [S, 3, *group, Dh], any strides, with the
        heads grouped as `group` (e.g. `(peers, heads_per_peer)`); bit-identical to `split()`."""
        group = tuple(out.shape[2:-1])
        self._rope(self.q[:, heads].unflatten(1, group), out=out[:, 0])
        self._rope(self.k[:, heads].unflatten(1, group), out=out[:, 1])
        if isinstance(self.v, LinearHeads):
            self.v.into(heads, out[:, 2])
        else:
            out[:, 2].copy_(self.v[:, heads].unflatten(1, group))


class AttentionCore(nn.Module):
    """Attention of q, k, v: [S, H, Dh] -> [S, H, Dh] with a named backend (a parallel plan wraps it).
    `record`: the rank's kernel record, attached by its runtime (None: not counted)."""

    def __init__(self, backend: str = "sdpa"):
        super().__init__()
        self.backend = backend
        self.record: Counter[str] | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return attend(q, k, v, self.backend, self.record)

    def attend_projected(self, qkv: ProjectedQKV) -> torch.Tensor:
        """Attention of a projection still to be finished (a wrapper may finish it where it needs it)."""
        return self(*qkv.split())


class Attention(nn.Module):
    """Fused qkv (no bias), per-head q/k RMSNorm, partial RoPE, SDPA, out_proj (no bias)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.head_dim = config.head_dim
        self.qkv_proj = linear_slot(3 * config.attention_width, config.hidden, bias=False)  # rows [q | k | v]
        self.q_norm = RMSNorm(config.head_dim, config.norm_eps)
        self.k_norm = RMSNorm(config.head_dim, config.norm_eps)
        self.core = AttentionCore()
        self.out_proj = linear_slot(config.hidden, config.attention_width, bias=False)

    def forward(self, h: torch.Tensor, rope: Rope | None) -> torch.Tensor:
        # h: [S, D] -> [S, D]. The head count comes from the qkv weight, so a head-sharded qkv just works.
        cos, sin = rope.local() if rope is not None else (None, None)
        q, k, v = self._project(h)  # [S, H, Dh] each (v maybe still lazy)
        o = self.core.attend_projected(ProjectedQKV(self.q_norm(q), self.k_norm(k), v, cos, sin))  # [S, H, Dh]
        return self.out_proj(o.flatten(1))

    def _project(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | LinearHeads]:
        """q, k: [S, H, Dh]; v: [S, H, Dh], or `LinearHeads` where the linear computes rows apart
        bitwise (the NVFP4 dequant paths), so that the attention core decides where v's GEMM writes."""
        width = self.qkv_proj.out_features // 3
        if not getattr(self.qkv_proj, "rows_apart", False):
            return self.qkv_proj(h).unflatten(-1, (3, -1, self.head_dim)).unbind(1)
        q, k = self.qkv_proj.forward_rows(h, slice(0, 2 * width)).unflatten(-1, (2, -1, self.head_dim)).unbind(1)
        return q, k, LinearHeads(self.qkv_proj, h, 2 * width, width // self.head_dim, self.head_dim)


class MLP(nn.Module):
    """SwiGLU: `fc2(silu(gate) * up)` with `fc1 = [gate; up]` (no biases)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.fc1 = linear_slot(2 * config.ffn_dim, config.hidden, bias=False)
        self.fc2 = linear_slot(config.hidden, config.ffn_dim, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        gate, up = self.fc1(h).chunk(2, dim=-1)  # [S, F] each
        return self.fc2(F.silu(gate) * up)


class AdaLNProjection(nn.Module):
    """`cond [M, E]` -> the modulation table `[M * 3, n, D]` (row `tidx * 3 + tag`) in the stream dtype.

    Full variant: `linear(silu(cond))` with SiLU taken in float32 and cast to the linear's dtype;
    pruned: `linear(cond)` in float32 (no SiLU). `modalities` 3 for a block, 1 for the final layer."""

    def __init__(self, config: ModelConfig, chunks: int, modalities: int):
        super().__init__()
        self.chunks, self.modalities, self.hidden = chunks, modalities, config.hidden
        self.silu = not config.pruned
        self.linear = linear_slot(modalities * chunks * config.hidden, config.time_embed_dim, bias=True)

    def forward(self, cond: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        x = F.silu(cond) if self.silu else cond
        table = self.linear(x.to(io_dtype(self.linear, dtype)))  # [M, modalities * chunks * D]
        return table.to(dtype).view(-1, self.chunks, self.hidden)  # [M * modalities, chunks, D]


class Block(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.norm1 = RMSNorm(config.hidden, config.norm_eps)
        self.attn = Attention(config)
        self.norm2 = RMSNorm(config.hidden, config.norm_eps)
        self.mlp = MLP(config)
        self.adaln_proj = AdaLNProjection(config, chunks=6, modalities=MODALITIES)

    def forward(self, x: torch.Tensor, cond: torch.Tensor, seq: PackedSequence, rows: list[int]) -> torch.Tensor:
        # x: [S, D]; cond: [M, E]; rows: each segment's AdaLN table row
        shift1, scale1, gate1, shift2, scale2, gate2 = self.adaln_proj(cond, x.dtype).unbind(1)  # [M * 3, D] each
        h = modulate(self.norm1(x), seq.segments, rows, shift1, scale1)
        x = add_gated(x, self.attn(h, seq.rope), seq.segments, rows, gate1)
        h = modulate(self.norm2(x), seq.segments, rows, shift2, scale2)
        return add_gated(x, self.mlp(h), seq.segments, rows, gate2)


class RefinerBlock(nn.Module):
    """Pre-norm attention + SwiGLU over the text rows only: no AdaLN, no RoPE."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.norm1 = RMSNorm(config.hidden, config.norm_eps)
        self.attn = Attention(config)
        self.norm2 = RMSNorm(config.hidden, config.norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), None)
        return x + self.mlp(self.norm2(x))


class TokenRefiner(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.blocks = nn.ModuleList(RefinerBlock(config) for _ in range(config.refiner_blocks))
        self.final_norm = RMSNorm(config.hidden, config.norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.final_norm(x)


class TimeEmbedder(nn.Module):
    """Full variant: `proj_out(silu(proj_in(sinusoid(t))))`, float32: t [M] -> [M, time_embed_dim]."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.channels = config.freq_dim
        self.proj_in = linear_slot(config.time_hidden, config.freq_dim, bias=True)
        self.proj_out = linear_slot(config.time_embed_dim, config.time_hidden, bias=True)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return self.proj_out(F.silu(self.proj_in(sinusoid(t, self.channels))))


class FinalLayer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.norm = RMSNorm(config.hidden, config.norm_eps)
        self.adaln_proj = AdaLNProjection(config, chunks=2, modalities=1)
        self.video_out = linear_slot(config.video_patch_dim, config.hidden, bias=True)
        self.audio_out = linear_slot(config.audio_channels, config.hidden, bias=True)

    def forward(self, x: torch.Tensor, cond: torch.Tensor, seq: PackedSequence, clocks: Clocks) -> dict[SegmentKind, torch.Tensor]:
        """Velocity rows (float32) of the video and audio rows held, each kind's rows in order."""
        shift, scale = self.adaln_proj(cond, x.dtype).unbind(1)  # [M, D] each
        normed = self.norm(x)
        heads = {SegmentKind.VIDEO: self.video_out, SegmentKind.AUDIO: self.audio_out}
        out: dict[SegmentKind, list[torch.Tensor]] = {}
        for seg in seq.segments:
            if seg.kind in heads:
                row = clocks.index[seg.clock]
                h = normed[seg.start : seg.stop] * (1.0 + scale[row]) + shift[row]
                out.setdefault(seg.kind, []).append(heads[seg.kind](h.to(io_dtype(heads[seg.kind], torch.float32))))
        return {kind: parts[0] if len(parts) == 1 else torch.cat(parts) for kind, parts in out.items()}


class Split(str, Enum):
    """How a linear divides over ranks in tensor mode (docs/nvfp4.md, "Tensor-parallel slicing")."""

    COLUMN = "column"
    """Output rows: each rank computes its rows of the output from the whole input; a bias is sliced with the rows."""
    ROW = "row"
    """Input columns (block aligned): each rank computes a partial output; a bias is added once after the sum."""


TENSOR_PARALLEL: dict[str, Split] = {
    "attn.qkv_proj": Split.COLUMN,  # the rows of this rank's heads, inside each of the q, k and v thirds
    "attn.out_proj": Split.ROW,  # the input columns of this rank's heads
    "mlp.fc1": Split.COLUMN,  # the same feature range inside the gate half and the up half
    "mlp.fc2": Split.ROW,  # the input columns of that feature range
}
"""The linears of every block that tensor mode splits, and how. The model declares this (as it
declares its shapes); `h3core.parallel` applies it from outside. The rest is replicated (the
token refiner and the AdaLN projections included)."""


def tensor_parallel_prefixes(num_blocks: int) -> tuple[str, ...]:
    """State-dict prefixes of every block's `TENSOR_PARALLEL` linears (tensor mode reads them as shards)."""
    return tuple(f"blocks.{i}.{name}." for i in range(num_blocks) for name in TENSOR_PARALLEL)


FP32_MODULES = ("video_patch_proj", "audio_patch_proj", "time_embedder", "final_layer.video_out", "final_layer.audio_out", "adaln_t_table")
"""The float32 islands of the released checkpoint (diffusers' `_keep_in_fp32_modules`); pruned
checkpoints add every `adaln_proj` (ComfyUI and SGLang upcast them)."""


class H3Model(nn.Module):
    """The MiniMax-H3 transformer, built on the meta device; `h3core.model.checkpoint` fills it."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        d = config.hidden
        self.config = config
        self.video_patch_proj = linear_slot(d, config.video_patch_dim, bias=True)
        self.audio_patch_proj = linear_slot(d, config.audio_channels, bias=True)
        self.condition_proj = linear_slot(d, config.text_dim, bias=True)
        if config.pruned:
            self.register_buffer("adaln_t_table", torch.empty(config.table_rows, config.time_embed_dim, device="meta"))
        else:
            self.time_embedder = TimeEmbedder(config)
        self.token_refiner = TokenRefiner(config)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.num_blocks))
        self.final_layer = FinalLayer(config)

    @property
    def dtype(self) -> torch.dtype:
        """The stream dtype (the residual stream, norms, attention, MLP)."""
        return self.final_layer.norm.weight.dtype

    def fp32_module(self, name: str) -> bool:
        """Whether the tensors under `name` load in float32 whatever the stream dtype (`FP32_MODULES`)."""
        if name.startswith(FP32_MODULES):
            return True
        return self.config.pruned and ".adaln_proj." in f".{name}"

    # --- the forward ---------------------------------------------------------------------------------

    def refine_text(self, states: torch.Tensor) -> torch.Tensor:
        """The text rows of the packed sequence from the text encoder's states: [L, text_dim] -> [L, D]."""
        x = self.condition_proj(states.to(io_dtype(self.condition_proj, self.dtype)))
        return self.token_refiner(x.to(self.dtype))

    def conditioning(self, t: torch.Tensor) -> torch.Tensor:
        """The AdaLN input of timesteps t [M]: the time MLP's [M, 2688] or the curve's [M, 8], float32."""
        if self.config.pruned:
            return curve(self.adaln_t_table, t)
        return self.time_embedder(t)

    def embed(self, seq: PackedSequence) -> torch.Tensor:
        """The rows held, in row order: [S, D] in the stream dtype (keyframe condition rows are video latent rows)."""
        projections = {SegmentKind.VIDEO: self.video_patch_proj, SegmentKind.CONDITION: self.video_patch_proj, SegmentKind.AUDIO: self.audio_patch_proj}
        taken = {kind: 0 for kind in seq.features}
        parts = []
        for seg in seq.segments:
            rows = seq.features[seg.kind][taken[seg.kind] : taken[seg.kind] + len(seg)]
            taken[seg.kind] += len(seg)
            if seg.kind is SegmentKind.TEXT:
                parts.append(rows.to(self.dtype))
            else:
                proj = projections[seg.kind]
                parts.append(proj(rows.to(io_dtype(proj, torch.float32))).to(self.dtype))
        return torch.cat(parts)

    def forward(self, *args, **kwargs) -> dict[SegmentKind, torch.Tensor] | tuple[torch.Tensor, torch.Tensor]:
        """`forward(seq: PackedSequence, clocks: Clocks)` -> velocity rows {kind: [n, features]} float32
        of the video and audio rows held; or diffusers' argument names (`forward_diffusers`)."""
        if args and isinstance(args[0], PackedSequence):
            return self.denoise_rows(*args, **kwargs)
        return self.forward_diffusers(*args, **kwargs)

    def denoise_rows(self, seq: PackedSequence, clocks: Clocks) -> dict[SegmentKind, torch.Tensor]:
        cond = self.conditioning(clocks.values)  # [M, E] float32
        rows = [clocks.row(seg) for seg in seq.segments]
        x = self.embed(seq)
        for block in self.blocks:
            x = block(x, cond, seq, rows)
        return self.final_layer(x, cond, seq, clocks)

    def forward_diffusers(
        self,
        hidden_states: torch.Tensor,
        audio_hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        timestep: torch.Tensor,
        timestep_indices: torch.Tensor,
        token_tags: torch.Tensor,
        position_ids: torch.Tensor,
        video_indices: torch.Tensor,
        audio_indices: torch.Tensor,
        text_indices: torch.Tensor,
        return_dict: bool = False,
        **_: object,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One packed sequence in diffusers' `MiniMaxH3Transformer3DModel.forward` convention (a leading
        batch axis of 1 accepted): the video and audio velocities `[1, n, features]` in the order of
        `video_indices` and `audio_indices`. `return_dict` is accepted and ignored (always a tuple)."""
        seq, clocks, order = diffusers_sequence(
            self, hidden_states, audio_hidden_states, encoder_hidden_states, timestep, timestep_indices,
            token_tags, position_ids, video_indices, audio_indices, text_indices,
        )
        out = self.denoise_rows(seq, clocks)
        return tuple(order(kind, out[kind]) for kind in (SegmentKind.VIDEO, SegmentKind.AUDIO))  # type: ignore[return-value]
