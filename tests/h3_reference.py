"""The reference side of the transformer tests: a small random diffusers `MiniMaxH3Transformer3DModel`,
written by the test into every layout h3 reads, and its inputs built as diffusers' pipeline builds them.

Nothing here uses h3: the original-layout state dict is the inverse of diffusers' own converter
(checked against it in `original_state`), the NVFP4 tensors come from comfy-kitchen's codec, and
the packed sequence from diffusers' `MiniMaxH3PrepareLayoutStep` / `MiniMaxH3SetTimestepsStep`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

SMALL = dict(
    num_attention_heads=4, attention_head_dim=16, hidden_size=48, num_layers=2, num_refiner_layers=2, ffn_dim=64,
    in_channels=24, audio_in_channels=32, text_dim=64, freq_dim=32, time_embed_hidden_dim=48, time_embed_dim=24, rope_freq_dim=2,
)
"""A small config of the real structure: hidden (48) != heads x head_dim (64), 12 of 16 head channels rotated."""

BLOCK_LINEARS = ("attn.qkv_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2")
PRUNED_RANK = 8
TABLE_ROWS = 1025


def random_model(seed: int = 0, **overrides: object):
    """A diffusers model with every parameter random (norm weights around 1), in float32, eval mode."""
    from diffusers import MiniMaxH3Transformer3DModel

    torch.manual_seed(seed)
    model = MiniMaxH3Transformer3DModel(**{**SMALL, **overrides}).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = 1.0 / math.sqrt(p.shape[-1]) if p.dim() > 1 else 0.1
            p.copy_(torch.randn(p.shape, generator=generator) * scale + (1.0 if "norm" in name else 0.0))
    return model


# --- diffusers -> the original names (every Comfy file, the official shards) -------------------------------

_RULES = [
    ("transformer_blocks.", "blocks."), ("token_refiner.refiner_blocks.", "token_refiner.blocks."),
    ("time_embedder.linear_1.", "time_embedder.proj_in."), ("time_embedder.linear_2.", "time_embedder.proj_out."),
    ("audio_proj_in.", "audio_patch_proj."), ("context_embedder.", "condition_proj."),
    ("norm_out.norm.", "final_layer.norm."), ("norm_out.linear.", "final_layer.adaln_proj.linear."),
    ("audio_proj_out.", "final_layer.audio_out."),
    (".attn.norm_q.", ".attn.q_norm."), (".attn.norm_k.", ".attn.k_norm."), (".attn.to_out.0.", ".attn.out_proj."),
    (".ff.net.0.proj.", ".mlp.fc1."), (".ff.net.2.", ".mlp.fc2."),
]


def _original_name(name: str) -> str:
    if name.startswith("proj_in."):
        return "video_patch_proj." + name[len("proj_in."):]
    if name.startswith("proj_out."):
        return "final_layer.video_out." + name[len("proj_out."):]
    for old, new in _RULES:
        if old.startswith(".") or name.startswith(old):
            name = name.replace(old, new, 1)
    return name


def original_state(model) -> dict[str, torch.Tensor]:
    """The model's weights by original names: qkv stacked `[q; k; v]`, fc1 `[gate; up]`, plus
    `rope.inv_freq`. Checked: diffusers' converter maps it back to the model's own state dict."""
    from diffusers.loaders.single_file_utils import convert_minimax_h3_transformer_checkpoint_to_diffusers

    diffusers_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    out: dict[str, torch.Tensor] = {}
    for name, tensor in diffusers_state.items():
        if ".attn.to_k." in name or ".attn.to_v." in name:
            continue
        if ".attn.to_q." in name:
            base = name.replace(".attn.to_q.weight", "")
            qkv = torch.cat([diffusers_state[f"{base}.attn.to_{p}.weight"] for p in "qkv"])
            out[_original_name(base) + ".attn.qkv_proj.weight"] = qkv
        elif ".ff.net.0.proj." in name:
            up, gate = tensor.chunk(2)
            out[_original_name(name)] = torch.cat([gate, up])
        else:
            out[_original_name(name)] = tensor
    out["rope.inv_freq"] = model.rope.inv_freq.detach().clone()
    back = convert_minimax_h3_transformer_checkpoint_to_diffusers(dict(out), dict(model.config))
    assert back.keys() == diffusers_state.keys() and all(torch.equal(back[k], diffusers_state[k]) for k in back)
    return out


def interleave_qkv(state: dict[str, torch.Tensor], heads: int, head_dim: int) -> dict[str, torch.Tensor]:
    """The official shards' per-head `[q_h; k_h; v_h]` row order of every qkv_proj."""
    out = dict(state)
    for name, tensor in state.items():
        if name.endswith(".attn.qkv_proj.weight"):
            out[name] = tensor.view(3, heads, head_dim, -1).transpose(0, 1).reshape(tensor.shape)
    return out


# --- writers -----------------------------------------------------------------------------------------------


def write_single(path: Path, state: dict[str, torch.Tensor], prefix: str = "", metadata: dict | None = None) -> Path:
    save_file({prefix + k: v.contiguous() for k, v in state.items()}, str(path), metadata=metadata or {"format": "pt"})
    return path


def write_sharded(folder: Path, state: dict[str, torch.Tensor], index: str = "model.safetensors.index.json", shards: int = 2) -> Path:
    """`state` in `shards` files plus a Hugging Face index, as the official release is laid out."""
    folder.mkdir(parents=True, exist_ok=True)
    names = sorted(state)
    weight_map = {}
    for i in range(shards):
        part = names[i::shards]
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({k: state[k].contiguous() for k in part}, str(folder / file), metadata={"format": "pt"})
        weight_map.update({k: file for k in part})
    (folder / index).write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))
    return folder


def quantize_block_linears(state: dict[str, torch.Tensor], layout: str = "comfy") -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Every block linear quantized by comfy-kitchen: (the stored tensors, the dequantized float weights).

    `layout` 'comfy': codes as comfy-kitchen packs them (high nibble first), its swizzled scales and a
    `comfy_quant` marker; 'modelopt': the same codes low nibble first, row-major scales, no marker."""
    import comfy_kitchen as ck
    from comfy_kitchen.float_utils import from_blocked

    stored, dense = dict(state), {}
    for name in list(state):
        prefix = name.removesuffix(".weight")
        if not (name.startswith("blocks.") and name.endswith(".weight") and prefix.split(".", 2)[2] in BLOCK_LINEARS):
            continue
        weight = state[name].float()
        scale2 = (weight.abs().amax() / (448 * 6)).float()
        codes, block = ck.quantize_nvfp4(weight, scale2, pad_16x=False)
        dense[name] = ck.dequantize_nvfp4(codes, scale2, block, torch.float32)
        del stored[name]
        if layout == "comfy":
            stored.update({f"{prefix}.weight": codes, f"{prefix}.weight_scale": block, f"{prefix}.weight_scale_2": scale2,
                           f"{prefix}.comfy_quant": torch.tensor(list(b'{"format": "nvfp4"}'), dtype=torch.uint8)})
        else:
            rows, cols = weight.shape
            low_first = (codes >> 4) | (codes << 4)
            table = from_blocked(block, num_rows=rows, num_cols=cols // 16)
            stored.update({f"{prefix}.weight": low_first, f"{prefix}.weight_scale": table.contiguous(), f"{prefix}.weight_scale_2": scale2})
    return stored, dense


def load_dense(model, dense: dict[str, torch.Tensor]) -> None:
    """Put dequantized block linears (original names) into the diffusers model."""
    with torch.no_grad():
        for name, weight in dense.items():
            block = int(name.split(".")[1])
            target = model.transformer_blocks[block]
            if ".attn.qkv_proj." in name:
                for part, rows in zip((target.attn.to_q, target.attn.to_k, target.attn.to_v), weight.chunk(3)):
                    part.weight.copy_(rows)
            elif ".attn.out_proj." in name:
                target.attn.to_out[0].weight.copy_(weight)
            elif ".mlp.fc1." in name:
                gate, up = weight.chunk(2)
                target.ff.net[0].proj.weight.copy_(torch.cat([up, gate]))
            else:
                target.ff.net[2].weight.copy_(weight)


# --- the pruned variant: the documented formula on diffusers' modules ---------------------------------------


def prune(model, seed: int = 1) -> dict[str, torch.Tensor]:
    """Make `model` a pruned-variant reference: every AdaLN projection reads an 8-wide curve
    `c(t) = lerp(table, clamp(t, 0, 1) * 1024)` with no SiLU, float32 (../shared/MINIMAX_H3.md §1.5).
    Returns the pruned tensors by original name (table and rank-8 projections) and patches the model."""
    import torch.nn as nn

    generator = torch.Generator().manual_seed(seed)
    grid = torch.linspace(0, 1, TABLE_ROWS)[:, None]
    table = torch.cat([torch.cos(grid * k * 3.0) for k in range(1, PRUNED_RANK + 1)], dim=1) + 0.1 * torch.randn(TABLE_ROWS, PRUNED_RANK, generator=generator)
    tensors = {"adaln_t_table": table}
    modules = [(f"blocks.{i}.adaln_proj.linear", block.adaln_proj) for i, block in enumerate(model.transformer_blocks)]
    modules.append(("final_layer.adaln_proj.linear", model.norm_out))
    for name, module in modules:
        out = module.linear.out_features
        linear = nn.Linear(PRUNED_RANK, out)
        with torch.no_grad():
            linear.weight.copy_(torch.randn(out, PRUNED_RANK, generator=generator) * 0.2)
            linear.bias.copy_(torch.randn(out, generator=generator) * 0.1)
        module.linear = linear
        tensors[f"{name}.weight"], tensors[f"{name}.bias"] = linear.weight.detach().clone(), linear.bias.detach().clone()

    model.time_proj = nn.Identity()  # the timestep goes to the curve untouched
    model.time_embedder = _Curve(table)
    for _, module in modules:
        module.forward = _no_silu(module)
    return tensors


class _Curve(torch.nn.Module):
    """`c(t) = table[i0] + (p - i0) (table[i0 + 1] - table[i0])`, `p = clamp(t, 0, 1) * (rows - 1)`."""

    def __init__(self, table: torch.Tensor):
        super().__init__()
        self.table = torch.nn.Parameter(table.clone(), requires_grad=False)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        rows = self.table.shape[0]
        position = t.float().clamp(0, 1) * (rows - 1)
        lower = position.floor().long().clamp(max=rows - 2)
        frac = (position - lower)[:, None]
        return self.table[lower] + frac * (self.table[lower + 1] - self.table[lower])


def _no_silu(module):
    """The module's forward with SiLU replaced by the identity (the pruned variant applies none)."""
    import types

    import torch.nn.functional as F

    original = type(module).forward

    def forward(self, *args):
        real, F.silu = F.silu, (lambda x: x)
        try:
            return original(self, *args)
        finally:
            F.silu = real

    return types.MethodType(forward, module)


def pruned_state(state: dict[str, torch.Tensor], pruned: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A full original state made pruned: no time_embedder, the table and rank-8 projections in."""
    out = {k: v for k, v in state.items() if not k.startswith("time_embedder.")}
    out.update(pruned)
    return out


# --- inputs, as diffusers' pipeline builds them -------------------------------------------------------------


def packed_inputs(model, *, text_tokens: int = 7, latent_frames: int = 2, latent_height: int = 4, latent_width: int = 6,
                  audio_latents: int = 5, t_video: float = 0.3, t_audio: float = 0.55, seed: int = 3) -> dict[str, torch.Tensor]:
    """The transformer's keyword arguments for one t2va step, built by diffusers' own layout and
    timestep steps (text | audio | video, positions, tags, row timesteps), with random latents and text."""
    from diffusers.modular_pipelines.minimax_h3.before_denoise import (
        MiniMaxH3PrepareLayoutStep,
        MiniMaxH3SetTimestepsStep,
        patchify_video_latents,
    )

    cfg = model.config
    generator = torch.Generator().manual_seed(seed)
    tags = torch.ones(text_tokens, dtype=torch.long)
    position_ids, token_tags, video_indices, audio_indices, text_indices, cond_v, cond_a = MiniMaxH3PrepareLayoutStep.build_packed_sequence(
        tags, latent_frames, latent_height, latent_width, audio_latents, tuple(cfg.patch_size), 2, 2, 0,
    )
    timestep, timestep_indices = MiniMaxH3SetTimestepsStep.build_row_timesteps(
        video_indices, audio_indices, cond_v, cond_a, text_tokens, t_video, t_audio, max(t_video, 0.999), 1.0,
    )
    latents = torch.randn(1, cfg.in_channels, latent_frames, latent_height, latent_width, generator=generator)
    return dict(
        hidden_states=patchify_video_latents(latents, tuple(cfg.patch_size))[None],
        audio_hidden_states=torch.randn(1, 2 * audio_latents, cfg.audio_in_channels, generator=generator),
        encoder_hidden_states=torch.randn(1, text_tokens, cfg.text_dim, generator=generator),
        timestep=timestep, timestep_indices=timestep_indices, token_tags=token_tags, position_ids=position_ids,
        video_indices=video_indices, audio_indices=audio_indices, text_indices=text_indices,
    )


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|."""
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


def reorder_bound(x: torch.Tensor, weight: torch.Tensor, y: torch.Tensor | None = None, accumulate: torch.dtype = torch.float32) -> torch.Tensor:
    """How far two GEMMs of the same `x @ weight.T`, accumulated in `accumulate`, may differ by the
    order of their sums alone (which the BLAS picks by shape and CPU): each is within gamma_K *
    (|x| @ |w|.T) of the exact product (K = the summed length, u = the dtype's unit roundoff), so the
    two within twice that; a bf16 output `y` adds one rounding (2^-8 relative) each."""
    k, u = x.shape[-1], torch.finfo(accumulate).eps / 2
    bound = 2 * (k * u / (1 - k * u)) * (x.to(accumulate).abs() @ weight.to(accumulate).abs().t())
    if y is not None and y.dtype == torch.bfloat16:
        bound = bound + 2.0**-8 * y.float().abs() * 2
    return bound
