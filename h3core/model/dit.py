"""The MiniMax-H3 transformer (../shared/MINIMAX_H3.md §1), h3's own implementation, with no parallelism.

It works on "some rows of a packed sequence": a `PackedSequence` says which segments those rows
hold (`text | audio | video`, local coordinates, each with its AdaLN tag and clock) and carries the
RoPE table of the whole sequence with the rows it covers. On one rank the rows are the whole
sequence; a parallel plan (h3core.parallel) feeds each rank its rows and reshapes modules from
outside: it swaps an attention module's processor (`Attention.processor`, Ulysses) or its linears
and adds hooks around it (tensor mode). Nothing here knows a rank, a group or a split.

Per forward (diffusers 0.42.1 `MiniMaxH3Transformer3DModel` is the specification; `forward` takes
one `PackedSequence` and its `Clocks`; diffusers' argument names go through
`h3core.model.packing.diffusers_forward`):

    text   = final_norm(refiner(condition_proj(states)))           once per request (`refine_text`)
    x      = [text rows | video_patch_proj(video rows) | audio_patch_proj(audio rows)]   in packed order
    cond   = full:   time_embedder(sinusoid_cos_first(t))           [M, 2688] fp32
             pruned: lerp(adaln_t_table, t * 1024)                  [M, 8]    fp32
    block: mod = adaln_proj(cond) -> [M * 3, 6, D]: row tidx * 3 + tag; shift, scale, gate (msa), (mlp),
           read by every row at once through its table row (`Clocks.table_rows`, one index_select)
           x += gate_msa * out_proj(SDPA(rope(q_norm(q)), rope(k_norm(k)), v)),  q|k|v = qkv_proj(RMS(x)*(1+scale)+shift)
           x += gate_mlp * fc2(silu(g) * u),                                     g|u = fc1(RMS(x)*(1+scale)+shift)
    out:   RMS(x) * (1 + scale[tidx]) + shift[tidx] -> fp32 -> video_out / audio_out

Numerics (§1.6): the patch projections, the timestep path and the output heads are float32 (and,
pruned, the AdaLN projections); everything else runs in the stream dtype (bf16 on a GPU, float32 on
the CPU by default). The full variant's SiLU(e) is taken in float32 and then cast to the AdaLN
projection's dtype, as the reference does.

Linears are `DenseLinear` or `NVFP4Linear` slots that the loader fills from the checkpoint
(`h3core.model.checkpoint`). Attention is `Attention` (the weights) computed by its `processor`
(`AttentionProcessor`), which calls one kernel interface (`h3core.model.attention.AttentionKernel`).
"""

from __future__ import annotations

import math
from typing import Iterable

import torch
import torch.nn as nn
import torch.nn.functional as F

from h3core.model.attention.dispatch import AttentionKernel
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
from h3core.model.rope import apply_rope
from h3core.model.sequence import MODALITIES, SegmentKind
from h3core.model.step_cache import FirstBlockCache
from h3core.nvfp4.kernels import DeviceKernels
from h3core.nvfp4.linear import DenseLinear, NVFP4Linear

Linear = DenseLinear | NVFP4Linear

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


def modulate(x: torch.Tensor, rows: torch.Tensor, shift_scale: torch.Tensor) -> torch.Tensor:
    """`x * (1 + scale[row]) + shift[row]` for every row at once, one gather for both. x: [S, D];
    rows: [S] (each row's AdaLN table row, `Clocks.table_rows`); shift_scale: the table's
    [M * 3, 2, D] of shift and `1 + scale` (the 1 added on the table, before the gather)."""
    shift, scale = shift_scale.index_select(0, rows).unbind(1)  # [S, D] each
    return x * scale + shift


def add_gated(x: torch.Tensor, y: torch.Tensor, rows: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """The residual `x + gate[row] * y` of every row (the gate raw: no tanh, no 1 +), in place. x, y: [S, D]; gate [M * 3, D]."""
    return x.add_(gate.index_select(0, rows) * y)


class AttentionProcessor(nn.Module):
    """How `Attention` computes on the rows it is given (diffusers' `AttnProcessor`): q|k|v from the
    fused projection, per-head RMSNorm of q and k, partial RoPE on the rows held, the attention
    kernel (`kernel`: the one interface to the backends, `h3core.model.attention`), the output
    projection. A parallel mode swaps the processor (Ulysses: `UlyssesProcessor`), never the model."""

    def __init__(self, kernel: AttentionKernel | None = None):
        super().__init__()
        self.kernel = kernel or AttentionKernel()

    def forward(self, attn: "Attention", h: torch.Tensor, rope: Rope | None) -> torch.Tensor:
        # h: [S, D] -> [S, D]. The head count comes from the qkv weight, so a head-sharded qkv just works.
        # q and k leave their norms as new tensors, rotated in place; v leaves the fused output's
        # strided slice by one copy: the kernel gets three contiguous [S, H, Dh] tensors.
        q, k, v = attn.qkv_proj(h).unflatten(-1, (3, -1, attn.head_dim)).unbind(1)  # [S, H, Dh] each
        q, k = attn.q_norm(q), attn.k_norm(k)
        if rope is not None:
            cos, sin = rope.local()  # [S, R/2]
            q, k = apply_rope(q, cos, sin, out=q), apply_rope(k, cos, sin, out=k)
        o = self.kernel(q, k, v.contiguous())  # [S, H, Dh]
        return attn.out_proj(o.flatten(1))


class Attention(nn.Module):
    """Fused qkv (no bias), per-head q/k RMSNorm, partial RoPE, attention, out_proj (no bias): the
    weights; `processor` computes with them (`AttentionProcessor`)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.head_dim = config.head_dim
        self.qkv_proj = linear_slot(3 * config.attention_width, config.hidden, bias=False)  # rows [q | k | v]
        self.q_norm = RMSNorm(config.head_dim, config.norm_eps)
        self.k_norm = RMSNorm(config.head_dim, config.norm_eps)
        self.out_proj = linear_slot(config.hidden, config.attention_width, bias=False)
        self.processor: AttentionProcessor = AttentionProcessor()

    def forward(self, h: torch.Tensor, rope: Rope | None) -> torch.Tensor:
        # h: [S, D] -> [S, D]; `rope` None: no RoPE (the token refiner)
        return self.processor(self, h, rope)


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

    def forward(self, x: torch.Tensor, cond: torch.Tensor, seq: PackedSequence, rows: torch.Tensor) -> torch.Tensor:
        # x: [S, D]; cond: [M, E]; rows: [S], each row's AdaLN table row (`Clocks.table_rows`)
        table = self.adaln_proj(cond, x.dtype)  # [M * 3, 6, D]: shift, scale, gate (attention), the same (MLP)
        table.unflatten(1, (2, 3))[:, :, 1].add_(1.0)  # both scales as 1 + scale, on the table's few rows
        h = modulate(self.norm1(x), rows, table[:, 0:2])
        x = add_gated(x, self.attn(h, seq.rope), rows, table[:, 2])
        h = modulate(self.norm2(x), rows, table[:, 3:5])
        return add_gated(x, self.mlp(h), rows, table[:, 5])


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

    def forward(self, seq: PackedSequence, clocks: Clocks, cache: FirstBlockCache | None = None) -> dict[SegmentKind, torch.Tensor]:
        """Velocity rows {kind: [n, features]} float32 of the video and audio rows `seq` holds, at the
        step's `clocks` (diffusers' argument names: `h3core.model.packing.diffusers_forward`); with
        `cache` (this sequence's step cache) blocks 1.. run only where it says so."""
        cond = self.conditioning(clocks.values)  # [M, E] float32
        x = self.embed(seq)
        rows = clocks.table_rows(seq.segments, x.device)  # [S]
        if cache is None:
            x = self.run_blocks(x, self.blocks, cond, seq, rows)
        else:
            x = cache.forward(x, lambda h: self.run_blocks(h, self.blocks[:1], cond, seq, rows),
                              lambda h: self.run_blocks(h, self.blocks[1:], cond, seq, rows))
        return self.final_layer(x, cond, seq, clocks)

    @staticmethod
    def run_blocks(x: torch.Tensor, blocks: Iterable[nn.Module], cond: torch.Tensor, seq: PackedSequence, rows: torch.Tensor) -> torch.Tensor:
        for block in blocks:
            x = block(x, cond, seq, rows)
        return x

    def set_attention_backend(self, backend: str | None = None, *, kernels: DeviceKernels | None = None) -> None:
        """Every attention kernel of the model runs `backend` (None: as it is), and answers its device
        questions with `kernels` (None: as it is; the loader gives the rank's)."""
        for module in self.modules():
            if isinstance(module, AttentionKernel):
                module.backend = backend or module.backend
                module.choices.device = kernels or module.choices.device
