"""The H3 denoiser (DESIGN.md §2): a single-stream joint DiT over one packed sequence.

This file holds no parallel code. It works on "some rows of a packed sequence": a
`PackedSequence` says which segments those rows hold (`text | video | audio`, in local
coordinates) and carries the RoPE table of the whole sequence with the rows it covers. On one
rank the rows are the whole sequence; a parallel plan (h3core.parallel) feeds each rank its own
rows and reshapes the modules from outside. Which linears tensor mode splits, and whether by rows or
columns, the model declares (`TENSOR_PARALLEL`, as Hugging Face models declare a tp plan).

Block, per segment `s` with modulation `shift/scale/gate`:
    h = LN(x) * (1 + scale1_s) + shift1_s
    x = x + gate1_s * Out(Attn(RoPE(RMSNorm(q)), RoPE(RMSNorm(k)), v)),   q|k|v = QKV(h)
    h = LN(x) * (1 + scale2_s) + shift2_s
    x = x + gate2_s * FC2(silu(gate) * value),                            gate|value = FC1(h)

Conditioning: `sigma` -> sinusoidal -> MLP -> `cond_kind` (+ a learned embedding per segment kind;
text is clean, so its timestep is 0) -> `time_proj` -> 6 modulation vectors per kind, added to each
block's learned table `[3, 6, D]`.

Dtypes: NVFP4 linears keep packed weights and dequantize in `forward`; dense parameters are
loaded in the compute dtype. Never call `model.to(dtype)`: it would cast the fp8 block scales.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace
from enum import Enum

import torch
import torch.nn as nn
import torch.nn.functional as F

from h3core.model.attention import attend
from h3core.model.config import ModelConfig
from h3core.model.sequence import KIND_INDEX, KINDS, Segment, SegmentKind
from h3core.nvfp4.linear import NVFP4Linear
from h3core.span import Span

# --- positions -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Rope:
    """RoPE angles of a whole packed sequence, and the rows of it that the activations hold."""

    cos: torch.Tensor  # [N, Dh/2]
    sin: torch.Tensor  # [N, Dh/2]
    rows: Span

    @property
    def num_tokens(self) -> int:
        return self.cos.shape[0]

    def local(self) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for `rows` only: [rows, Dh/2] each."""
        return self.cos[self.rows.start : self.rows.stop], self.sin[self.rows.start : self.rows.stop]

    def whole(self) -> "Rope":
        return replace(self, rows=Span(0, self.num_tokens))

    def select(self, rows: Span) -> "Rope":
        return replace(self, rows=rows)

    def to(self, device: torch.device | str) -> "Rope":
        return replace(self, cos=self.cos.to(device), sin=self.sin.to(device))


def token_positions(segments: list[Segment], video_grid: tuple[int, int, int]) -> torch.Tensor:
    """Positions `(t, h, w)` of every token, float32 `[N, 3]`.

    Video tokens get their 3-D grid position; text and audio tokens are 1-D: position `p` on all
    three axes, which makes the 3-axis rotation an ordinary 1-D RoPE over the whole head.
    """
    parts = []
    for seg in segments:
        n = len(seg)
        if seg.kind is SegmentKind.VIDEO:
            t, h, w = video_grid
            if n != t * h * w:
                raise ValueError(f"video segment of {n} tokens does not match grid {video_grid}")
            grid = torch.stack(torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij"), -1)
            parts.append(grid.reshape(n, 3))
        else:
            parts.append(torch.arange(n)[:, None].expand(n, 3))
    return torch.cat(parts).to(torch.float32)


def rope_table(config: ModelConfig, positions: torch.Tensor) -> Rope:
    """Angles for positions `[N, 3]`: axis `a` owns `rope_axes[a] / 2` frequency bands of the half head."""
    angles = []
    for axis, dim in enumerate(config.rope_axes):
        freqs = config.rope_theta ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)  # [dim/2]
        angles.append(positions[:, axis, None].double() * freqs[None])  # [N, dim/2]
    theta = torch.cat(angles, dim=-1)  # [N, Dh/2]
    return Rope(cos=theta.cos().float(), sin=theta.sin().float(), rows=Span(0, positions.shape[0]))


ROPE_CHUNK_BYTES = 1 << 20
"""On the CPU, RoPE over more than 4 x this many bytes of float32 input runs over row chunks of
about this size, so that its passes (rotate, two products, sum, write) stay in cache instead of each
streaming the whole activation through memory: ~1.6x faster at H3's 56 x 128 heads (1 MiB was the
fastest of 0.1-7 MiB on 2-rank to 8-rank shapes; docs/performance.md). Smaller inputs stay in cache
anyway and run in one pass, as every input does on a GPU."""


def rope_chunk_rows(x: torch.Tensor) -> int:
    """Rows of x that `apply_rope` takes per pass: every row on a GPU or for a small x, else ~ROPE_CHUNK_BYTES."""
    rows = x.shape[0]
    row_bytes = 4 * math.prod(x.shape[1:])  # computed in float32 whatever x's dtype
    if x.device.type != "cpu" or rows * row_bytes <= 4 * ROPE_CHUNK_BYTES:
        return max(rows, 1)
    return max(1, ROPE_CHUNK_BYTES // max(row_bytes, 1))


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Rotate-half RoPE, computed in float32. x: [S, *heads, Dh] (e.g. [S, H, Dh]); cos, sin: [S, Dh/2].

    `x * [cos, cos] + [x2, x1] * [-sin, sin]`: per element the same two products and one sum as
    `[x1 cos - x2 sin, x2 cos + x1 sin]`, so the same bits. With `out` (x's shape, any dtype, any
    strides) the result is written there instead of into a new tensor; in float32 straight into it,
    whole head rows at a time (what lets Ulysses attention skip its pack copy). Every element is
    computed alone, so the chunks of rows (`rope_chunk_rows`) give the same bits as one pass.
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
    half = x.shape[-1] // 2
    xf = x.float()
    broadcast = (cos.shape[0],) + (1,) * (x.dim() - 2) + (half,)  # [S, 1.., Dh/2]
    c, s = cos.reshape(broadcast), sin.reshape(broadcast)
    cos2, sin2 = torch.cat([c, c], dim=-1), torch.cat([-s, s], dim=-1)  # [S, 1.., Dh]
    rotated = torch.cat([xf[..., half:], xf[..., :half]], dim=-1).mul_(sin2)  # [x2, x1] * [-sin, sin]
    if out is None:
        return torch.mul(xf, cos2).add_(rotated).to(x.dtype)
    return torch.add(torch.mul(xf, cos2), rotated, out=out)  # summed in float32, written once in out's dtype


# --- packed inputs -------------------------------------------------------------------------------


@dataclass
class PackedSequence:
    """Rows of a packed `text | video | audio` sequence, as one rank (or the only rank) holds them.

    `features[kind]` holds that kind's rows in order: text `[n, text_dim]` hidden states, video
    `[n, video_patch_dim]` and audio `[n, audio_patch_dim]` latent patches. `segments` are in local
    row coordinates (0 = first row held); `rope.rows` says where those rows sit in the sequence.
    """

    segments: list[Segment]
    features: dict[SegmentKind, torch.Tensor]
    rope: Rope


# --- patches -------------------------------------------------------------------------------------


def patchify_video(latent: torch.Tensor, patch: tuple[int, int, int]) -> torch.Tensor:
    """[C, T, H, W] -> [T/pt * H/ph * W/pw, C*pt*ph*pw], tokens in (t, h, w) order."""
    c, t, h, w = latent.shape
    pt, ph, pw = patch
    x = latent.reshape(c, t // pt, pt, h // ph, ph, w // pw, pw)
    return x.permute(1, 3, 5, 0, 2, 4, 6).reshape((t // pt) * (h // ph) * (w // pw), c * pt * ph * pw)


def unpatchify_video(tokens: torch.Tensor, shape: tuple[int, int, int, int], patch: tuple[int, int, int]) -> torch.Tensor:
    """Inverse of `patchify_video`: [N, C*pt*ph*pw] -> [C, T, H, W]."""
    c, t, h, w = shape
    pt, ph, pw = patch
    x = tokens.reshape(t // pt, h // ph, w // pw, c, pt, ph, pw)
    return x.permute(3, 0, 4, 1, 5, 2, 6).reshape(c, t, h, w)


def patchify_audio(latent: torch.Tensor, patch: int) -> torch.Tensor:
    """[C, L] -> [L/p, C*p]."""
    c, length = latent.shape
    return latent.reshape(c, length // patch, patch).permute(1, 0, 2).reshape(length // patch, c * patch)


def unpatchify_audio(tokens: torch.Tensor, shape: tuple[int, int], patch: int) -> torch.Tensor:
    c, length = shape
    return tokens.reshape(length // patch, c, patch).permute(1, 0, 2).reshape(c, length)


# --- layers --------------------------------------------------------------------------------------


def layer_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """LayerNorm without affine parameters (AdaLN supplies them), computed in float32."""
    return F.layer_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def modulate(x: torch.Tensor, segments: list[Segment], shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Per-segment `x * (1 + scale_k) + shift_k`. x: [S, D]; shift, scale: [3, D] indexed by kind."""
    out = torch.empty_like(x)
    for seg in segments:
        k = KIND_INDEX[seg.kind]
        out[seg.start : seg.stop] = torch.addcmul(shift[k], x[seg.start : seg.stop], 1 + scale[k])
    return out


def add_gated(x: torch.Tensor, y: torch.Tensor, segments: list[Segment], gate: torch.Tensor) -> torch.Tensor:
    """Per-segment residual `x += gate_k * y`, in place. x, y: [S, D]; gate: [3, D]."""
    for seg in segments:
        x[seg.start : seg.stop].addcmul_(y[seg.start : seg.stop], gate[KIND_INDEX[seg.kind]])
    return x


def timestep_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Sinusoidal embedding. t: [n] -> [n, dim] float32 (cos half, then sin half)."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    args = t.float()[:, None] * freqs[None]
    return torch.cat([args.cos(), args.sin()], dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim, device="meta"), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * self.weight.float()).to(x.dtype)


def nvfp4_linear(out_features: int, in_features: int, bias: bool = True) -> NVFP4Linear:
    """An NVFP4 linear skeleton on the meta device; the checkpoint loader fills it."""
    return NVFP4Linear.skeleton(out_features, in_features, bias=bias, device="meta")


def dense_linear(out_features: int, in_features: int) -> nn.Linear:
    """A small unquantized linear (patch embeddings and output projections stay dense)."""
    return nn.Linear(in_features, out_features, device="meta").requires_grad_(False)


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
    rotated; v a tensor, or `LinearHeads` still to be computed.

    `split()` finishes them (RoPE on q and k, v computed) into q, k, v: [S, H, Dh] each, what a rank
    attends over. `write(heads, out)` writes the same values for a range of heads into a destination
    laid out differently, e.g. an all-to-all's send buffer, so that nothing is copied on the way out.
    """

    q: torch.Tensor  # [S, H, Dh], RMS-normalised
    k: torch.Tensor  # [S, H, Dh], RMS-normalised
    v: torch.Tensor | LinearHeads  # [S, H, Dh]
    cos: torch.Tensor  # [S, Dh/2]
    sin: torch.Tensor  # [S, Dh/2]

    def split(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        v = self.v.compute() if isinstance(self.v, LinearHeads) else self.v
        return apply_rope(self.q, self.cos, self.sin), apply_rope(self.k, self.cos, self.sin), v

    def write(self, heads: slice, out: torch.Tensor) -> None:
        """Heads `heads` of q, k (rotated) and v into out: [S, 3, *group, Dh], any strides, with the
        heads grouped as `group` (e.g. `(peers, heads_per_peer)`); bit-identical to `split()`.
        A lazy v is computed by its GEMM straight into `out[:, 2]`."""
        group = tuple(out.shape[2:-1])
        apply_rope(self.q[:, heads].unflatten(1, group), self.cos, self.sin, out=out[:, 0])
        apply_rope(self.k[:, heads].unflatten(1, group), self.cos, self.sin, out=out[:, 1])
        if isinstance(self.v, LinearHeads):
            self.v.into(heads, out[:, 2])
        else:
            out[:, 2].copy_(self.v[:, heads].unflatten(1, group))


class AttentionCore(nn.Module):
    """Attention of q, k, v: [S, H, Dh] -> [S, H, Dh] with a named backend (a parallel plan wraps it)."""

    def __init__(self, backend: str = "sdpa"):
        super().__init__()
        self.backend = backend

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return attend(q, k, v, self.backend)

    def attend_projected(self, qkv: ProjectedQKV) -> torch.Tensor:
        """Attention of a projection still to be finished (a wrapper may finish it where it needs it)."""
        return self(*qkv.split())


class Attention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        d = config.hidden
        self.head_dim = config.head_dim
        self.qkv = nvfp4_linear(3 * d, d)  # rows: [q | k | v], head-major inside each third
        self.norm_q = RMSNorm(config.head_dim, config.norm_eps)
        self.norm_k = RMSNorm(config.head_dim, config.norm_eps)
        self.core = AttentionCore()
        self.out = nvfp4_linear(d, d)

    def forward(self, h: torch.Tensor, rope: Rope) -> torch.Tensor:
        # h: [S, D] -> [S, D]. The head count comes from the qkv weight, so a head-sharded qkv just works.
        cos, sin = rope.local()
        q, k, v = self._project(h)  # [S, H, Dh] each (v maybe still lazy)
        o = self.core.attend_projected(ProjectedQKV(self.norm_q(q), self.norm_k(k), v, cos, sin))  # [S, H, Dh]
        return self.out(o.flatten(1))

    def _project(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | LinearHeads]:
        """q, k: [S, H, Dh]; v: [S, H, Dh], or `LinearHeads` where the linear computes rows apart
        (the dequant paths), so that the attention core decides where v's GEMM writes (bitwise the
        same values). The fp4 paths keep one fused GEMM: one activation scale for q|k|v."""
        width = self.qkv.out_features // 3
        if not self.qkv.rows_apart:
            return self.qkv(h).unflatten(-1, (3, -1, self.head_dim)).unbind(1)
        q, k = self.qkv.forward_rows(h, slice(0, 2 * width)).unflatten(-1, (2, -1, self.head_dim)).unbind(1)
        return q, k, LinearHeads(self.qkv, h, 2 * width, width // self.head_dim, self.head_dim)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.fc1 = nvfp4_linear(2 * config.mlp_width, config.hidden)  # rows: [gate | value]
        self.fc2 = nvfp4_linear(config.hidden, config.mlp_width)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        gate, value = self.fc1(h).chunk(2, dim=-1)  # [S, F] each
        return self.fc2(F.silu(gate) * value)


class Split(str, Enum):
    """How a linear divides over ranks in tensor mode (docs/nvfp4.md, "Tensor-parallel slicing")."""

    COLUMN = "column"
    """Output rows: each rank computes its rows of the output from the whole input; the bias is sliced with the rows."""
    ROW = "row"
    """Input columns (block aligned): each rank computes a partial output; the bias is added once after the sum."""


TENSOR_PARALLEL: dict[str, Split] = {
    "attn.qkv": Split.COLUMN,  # the rows of this rank's heads, inside each of the q, k and v thirds
    "attn.out": Split.ROW,  # the input columns of this rank's heads
    "mlp.fc1": Split.COLUMN,  # the same feature range inside the gate half and the value half
    "mlp.fc2": Split.ROW,  # the input columns of that feature range
}
"""The linears of every block that tensor mode splits, and how. The model declares this (as it
declares its shapes); `h3core.parallel` applies it from outside: the plan computes each rank's
ranges, `parallelize` swaps the modules. The rest of the model is replicated."""


def tensor_parallel_prefixes(num_blocks: int) -> tuple[str, ...]:
    """State-dict prefixes of every block's `TENSOR_PARALLEL` linears (tensor mode reads them as shards)."""
    return tuple(f"blocks.{i}.{name}." for i in range(num_blocks) for name in TENSOR_PARALLEL)


class Block(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.eps = config.norm_eps
        self.modulation = nn.Parameter(torch.empty(len(KINDS), 6, config.hidden, device="meta"), requires_grad=False)
        self.attn = Attention(config)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, mod: torch.Tensor, segments: list[Segment], rope: Rope) -> torch.Tensor:
        # x: [S, D]; mod: [3, 6, D] from the timestep
        shift1, scale1, gate1, shift2, scale2, gate2 = (self.modulation + mod).unbind(1)  # [3, D] each
        x = add_gated(x, self.attn(modulate(layer_norm(x, self.eps), segments, shift1, scale1), rope), segments, gate1)
        x = add_gated(x, self.mlp(modulate(layer_norm(x, self.eps), segments, shift2, scale2)), segments, gate2)
        return x


class FinalLayer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.eps = config.norm_eps
        self.modulation = nn.Parameter(torch.empty(len(KINDS), 2, config.hidden, device="meta"), requires_grad=False)
        self.video_out = dense_linear(config.video_patch_dim, config.hidden)
        self.audio_out = dense_linear(config.audio_patch_dim, config.hidden)

    def forward(self, x: torch.Tensor, cond: torch.Tensor, segments: list[Segment]) -> dict[SegmentKind, torch.Tensor]:
        shift, scale = (self.modulation + cond[:, None, :]).unbind(1)  # [3, D] each
        h = modulate(layer_norm(x, self.eps), segments, shift, scale)
        proj = {SegmentKind.VIDEO: self.video_out, SegmentKind.AUDIO: self.audio_out}
        return {seg.kind: proj[seg.kind](h[seg.start : seg.stop]) for seg in segments if seg.kind in proj}


class H3Model(nn.Module):
    """The denoiser. Built on the meta device; `h3core.model.checkpoint` loads its weights."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        d = config.hidden
        self.config = config
        self.text_embed = nvfp4_linear(d, config.text_dim)
        self.video_embed = dense_linear(d, config.video_patch_dim)
        self.audio_embed = dense_linear(d, config.audio_patch_dim)
        self.time_in = nvfp4_linear(d, config.time_embed_dim)
        self.time_out = nvfp4_linear(d, d)
        self.kind_embed = nn.Parameter(torch.empty(len(KINDS), d, device="meta"), requires_grad=False)
        self.time_proj = nvfp4_linear(6 * d, d)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.num_blocks))
        self.final = FinalLayer(config)

    @property
    def dtype(self) -> torch.dtype:
        return self.kind_embed.dtype

    def conditioning(self, sigma: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """sigma (0-dim) -> cond [3, D] per segment kind, and block modulation offsets [3, 6, D]."""
        t = torch.stack([torch.zeros_like(sigma), sigma, sigma]).float() * 1000.0  # text is clean
        emb = timestep_embedding(t, self.config.time_embed_dim).to(self.dtype)  # [3, T]
        cond = self.time_out(F.silu(self.time_in(emb))) + self.kind_embed  # [3, D]
        mod = self.time_proj(F.silu(cond)).unflatten(-1, (6, self.config.hidden))  # [3, 6, D]
        return cond, mod

    def embed(self, seq: PackedSequence) -> torch.Tensor:
        """Per-segment input projections, concatenated in row order: [S, D]."""
        proj = {SegmentKind.TEXT: self.text_embed, SegmentKind.VIDEO: self.video_embed, SegmentKind.AUDIO: self.audio_embed}
        return torch.cat([proj[seg.kind](seq.features[seg.kind].to(self.dtype)) for seg in seq.segments])

    def forward(self, seq: PackedSequence, sigma: torch.Tensor) -> dict[SegmentKind, torch.Tensor]:
        """Velocity rows for the video and audio rows `seq` holds: {kind: [n_kind, patch_dim]}."""
        cond, mod = self.conditioning(sigma)
        x = self.embed(seq)
        for block in self.blocks:
            x = block(x, mod, seq.segments, seq.rope)
        return self.final(x, cond, seq.segments)
