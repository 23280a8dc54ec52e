"""H3's video VAE ("f16t4d24") in diffusers' `AutoencoderKLMiniMaxH3`, from either key layout.

The model is diffusers' own class (diffusers 0.42.1, `models/autoencoders/autoencoder_kl_minimax_h3.py`):
h3 only maps the original/Comfy tensor names onto it. diffusers 0.42.1 has no converter for this VAE's
original layout (its `single_file_utils` converts only the transformer), so the map is h3's, from the
two module trees (MiniMax-AI/MiniMax-H3 `FL2VA/video_vae/{vae_vit,attention,base_module}.py`, ComfyUI
`comfy/ldm/minimax/vae.py`, both read) and tested against a block computed from the original layout's
definition:

| original / Comfy | diffusers |
|---|---|
| `encoder.down.I.block.J.{norm1,conv1,norm2,conv2}` | `encoder.down_blocks.I.resnets.J.*` |
| `encoder.down.I.block.J.nin_shortcut` | `encoder.down_blocks.I.resnets.J.conv_shortcut` |
| `encoder.down.I.downsample.conv` | `encoder.down_blocks.I.downsamplers.0.conv` |
| `decoder.x_embedder` | `decoder.proj_in` |
| `decoder.transformer_blocks.K.attn.to_qkv` (rows per head: q_h, k_h, v_h) | `...attn.to_q` / `to_k` / `to_v` |
| `decoder.transformer_blocks.K.attn.to_out` | `...attn.to_out.0` |
| `decoder.transformer_blocks.K.ff.w1` ([gate; value]) | `...ff.net.0.proj` ([value; gate]: diffusers' SwiGLU) |
| `decoder.transformer_blocks.K.ff.w2` | `...ff.net.2` |
| `decoder.mask_token` (unused at inference), `latents_mean`, `latents_std` | (dropped; the two statistics go to the config) |

Everything else keeps its name. The structure (6 encoder levels, 16x spatial and 4x temporal
compression, 17-frame clips, 3 dropped latent frames, 64-wide decoder heads, RoPE theta 100 on 3/4 of
each head) is fixed; the widths and depths are read from the tensors' shapes, so the small synthetic
VAE and the real one load the same way.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Mapping

from h3core.checkpoints import numbered
from h3core.errors import CheckpointError

if TYPE_CHECKING:
    import torch

STRUCTURE: dict[str, object] = {
    "in_channels": 3,
    "out_channels": 3,
    "spatial_downsample_factors": (2, 2, 2, 2, 1, 1),
    "temporal_downsample_factors": (1, 2, 2, 1, 1, 1),
    "norm_num_groups": 32,
    "norm_eps": 1e-6,
    "spatial_padding_mode": "reflect",
    "decoder_attention_head_dim": 64,
    "decoder_rope_theta": 100.0,
    "decoder_rope_dim_ratio": 0.75,
    "decoder_norm_eps": 1e-5,
    "clip_length": 17,
    "token_drop": 3,
}
"""What the shapes cannot say and H3's geometry depends on (MiniMax `FL2VA/video_vae/source/config.json`,
`video_vae/config.json`; diffusers' defaults are the same)."""

HEAD_DIM = 64
PATCH_VALUES = 3 * 4 * 16 * 16
"""`decoder.proj_out` rows: RGB x 4 frames x 16 x 16 pixels per latent voxel."""

PUBLISHED_LATENTS_MEAN = (
    0.858090341091156, -0.9606591463088989, 1.0661640167236328, -0.5090325474739075,
    -0.2727581858634949, -1.3675414323806763, -0.2553254961967468, -0.26907554268836975,
    -0.5376840829849243, -0.0464097298681736, 0.6657370328903198, 0.19690127670764923,
    -0.5460608005523682, -0.4035342037677765, -0.23683024942874908, 0.25928452610969543,
    -0.30133944749832153, 0.211341992020607, -1.1206848621368408, 0.3581933379173279,
    -0.04225143790245056, 0.2604829967021942, 0.22864092886447906, 0.7056031823158264,
)  # fmt: skip
PUBLISHED_LATENTS_STD = (
    1.2223774194717407, 1.2767263650894165, 1.68317747116088865, 1.7549455165863037,
    1.5636216402053833, 2.194143533706665, 0.96531379222869875, 1.05698859691619875,
    0.841948926448822, 0.7729952931404114, 1.8955937623977661, 0.946841835975647,
    0.7996809482574463, 0.44988900423049925, 0.7197399735450745, 0.69362932443618775,
    2.961095094680786, 2.7694199085235595, 3.0496184825897215, 2.1088054180145265,
    3.276226282119751, 3.1627357006073, 2.28168129920959475, 2.6127843856811525,
)  # fmt: skip
"""The video latent statistics MiniMax publishes (`FL2VA/video_vae/config.json`; the same in ComfyUI's
`vae.py`), used for a file that does not carry its own."""

# (original, diffusers) name prefixes, "{i}" / "{j}" an index kept as it is; the first that matches renames
# a name, both ways (the more specific first); the rest keep their names.
_NAME_PAIRS = (
    ("encoder.down.{i}.block.{j}.nin_shortcut.", "encoder.down_blocks.{i}.resnets.{j}.conv_shortcut."),
    ("encoder.down.{i}.block.{j}.", "encoder.down_blocks.{i}.resnets.{j}."),
    ("encoder.down.{i}.downsample.conv.", "encoder.down_blocks.{i}.downsamplers.0.conv."),
    ("decoder.x_embedder.", "decoder.proj_in."),
    ("decoder.transformer_blocks.{i}.attn.to_out.", "decoder.transformer_blocks.{i}.attn.to_out.0."),
    ("decoder.transformer_blocks.{i}.ff.w2.", "decoder.transformer_blocks.{i}.ff.net.2."),
)


def _prefix_rule(source: str, target: str) -> tuple[str, str]:
    """(pattern, replacement) that renames the prefix `source` to `target`, indices kept."""
    pattern, replacement, group = "^" + re.escape(source), target, 0
    for index in ("{i}", "{j}"):
        if index in source:
            group += 1
            pattern, replacement = pattern.replace(re.escape(index), r"(\d+)"), replacement.replace(index, f"\\{group}")
    return pattern, replacement


_RENAMES = tuple(_prefix_rule(original, diffusers) for original, diffusers in _NAME_PAIRS)
_BACK = tuple(_prefix_rule(diffusers, original) for original, diffusers in _NAME_PAIRS)
_QKV = re.compile(r"^(decoder\.transformer_blocks\.\d+\.attn)\.to_qkv\.(weight|bias)$")
_W1 = re.compile(r"^(decoder\.transformer_blocks\.\d+\.ff)\.w1\.(weight|bias)$")
_Q = re.compile(r"^(decoder\.transformer_blocks\.\d+\.attn)\.to_q\.(weight|bias)$")
_PROJ = re.compile(r"^(decoder\.transformer_blocks\.\d+\.ff)\.net\.0\.proj\.(weight|bias)$")
DROPPED = ("decoder.mask_token", "latents_mean", "latents_std")
DECODER_ONLY_SKIPS = ("encoder.", "quant_conv.")
"""What decoding never touches (diffusers' `decode` uses `post_quant_conv` and `decoder` only)."""
ENCODER_ONLY_SKIPS = ("decoder.", "post_quant_conv.")
"""What encoding never touches (diffusers' `encode` uses `encoder` and `quant_conv` only)."""


def compute_buffers(model: "torch.nn.Module") -> None:
    """Make, on the CPU, the buffers diffusers' class computes in its constructor and no file holds,
    for a model built on the meta device: the decoder's RoPE frequencies (`inv_freq`), by building
    diffusers' own parameterless `MiniMaxH3VideoRotaryPosEmbed` from the model's config."""
    import torch
    from diffusers.models.autoencoders.autoencoder_kl_minimax_h3 import MiniMaxH3VideoRotaryPosEmbed

    config = model.config
    with torch.device("cpu"):
        model.decoder.rope = MiniMaxH3VideoRotaryPosEmbed(
            int(config.decoder_attention_head_dim * config.decoder_rope_dim_ratio), theta=config.decoder_rope_theta
        )


def _rename(name: str, table: tuple[tuple[str, str], ...]) -> str:
    for pattern, replacement in table:
        new, count = re.subn(pattern, replacement, name)
        if count:
            return new
    return name


def split_qkv(fused: "torch.Tensor", heads: int) -> tuple["torch.Tensor", "torch.Tensor", "torch.Tensor"]:
    """The original `to_qkv` rows, per head [q_h; k_h; v_h] -> (q, k, v), each head-major."""
    per_head = fused.reshape(heads, 3, -1, *fused.shape[1:])  # [heads, 3, head_dim, (in)]
    return tuple(per_head[:, i].reshape(-1, *fused.shape[1:]) for i in range(3))  # type: ignore[return-value]


def merge_qkv(q: "torch.Tensor", k: "torch.Tensor", v: "torch.Tensor", heads: int) -> "torch.Tensor":
    """(q, k, v) -> the original per-head interleaved `to_qkv` rows (inverse of `split_qkv`)."""
    import torch

    parts = [t.reshape(heads, -1, *t.shape[1:]) for t in (q, k, v)]  # [heads, head_dim, (in)]
    return torch.stack(parts, dim=1).reshape(-1, *q.shape[1:])


def swap_halves(t: "torch.Tensor") -> "torch.Tensor":
    """[a; b] -> [b; a] along rows: the original SwiGLU's [gate; value] <-> diffusers' [value; gate]."""
    import torch

    first, second = t.chunk(2, dim=0)
    return torch.cat([second, first], dim=0)


def original_to_diffusers(tensors: Mapping[str, "torch.Tensor"], heads: int) -> dict[str, "torch.Tensor"]:
    """Original/Comfy tensors -> diffusers' names and row orders (`DROPPED` names are left out)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if name in DROPPED:
            continue
        if match := _QKV.match(name):
            base, kind = match.groups()
            for part, piece in zip(("to_q", "to_k", "to_v"), split_qkv(tensor, heads)):
                out[f"{base}.{part}.{kind}"] = piece.contiguous()
        elif match := _W1.match(name):
            base, kind = match.groups()
            out[f"{base}.net.0.proj.{kind}"] = swap_halves(tensor)
        else:
            out[_rename(name, _RENAMES)] = tensor
    return out


def diffusers_to_original(tensors: Mapping[str, "torch.Tensor"], heads: int) -> dict[str, "torch.Tensor"]:
    """diffusers' tensors -> the original/Comfy names and row orders (the synthetic VAE's file)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if name.endswith((".to_k.weight", ".to_k.bias", ".to_v.weight", ".to_v.bias")):
            continue  # merged with to_q below
        if match := _Q.match(name):
            base, kind = match.groups()
            q, k, v = (tensors[f"{base}.{p}.{kind}"] for p in ("to_q", "to_k", "to_v"))
            out[f"{base}.to_qkv.{kind}"] = merge_qkv(q, k, v, heads)
        elif match := _PROJ.match(name):
            base, kind = match.groups()
            out[f"{base}.w1.{kind}"] = swap_halves(tensor)
        else:
            out[_rename(name, _BACK)] = tensor
    return out


# --- the config from the shapes ------------------------------------------------------------------------


def config_from_shapes(shapes: Mapping[str, tuple[int, ...]], layout: str, where: str) -> dict[str, object]:
    """diffusers' `AutoencoderKLMiniMaxH3` config (less the latent statistics) from a file's
    tensor shapes in `layout` ('original' or 'diffusers'); a file whose structure is not H3's
    (levels, downsamplers, patch) is a CheckpointError naming `where`."""
    names = shapes if layout == "original" else _original_names(shapes)
    need = _needs(names, where)
    latent = need("post_quant_conv.weight")[0]
    levels = _count(names, "encoder.down.", where)
    expected_levels = len(STRUCTURE["spatial_downsample_factors"])  # type: ignore[arg-type]
    if levels != expected_levels:
        raise CheckpointError(f"{where}: the encoder has {levels} levels, H3's video VAE has {expected_levels}; not an H3 video VAE")
    _check_downsamplers(names, where)
    width = need("decoder.x_embedder.weight")
    dim = width[0]
    if width[1] != latent or dim % HEAD_DIM:
        raise CheckpointError(f"{where}: decoder.x_embedder is {list(width)}; H3's decoder maps {latent} latent channels to a multiple of {HEAD_DIM}")
    ff_rows = need("decoder.transformer_blocks.0.ff.w1.weight")[0]
    if ff_rows % (2 * dim) or need("decoder.proj_out.weight")[0] != PATCH_VALUES:
        raise CheckpointError(f"{where}: the decoder's feed-forward or output projection is not H3's (3 x 4 x 16 x 16 values per latent)")
    return {
        **STRUCTURE,
        "latent_channels": latent,
        "block_out_channels": tuple(need(f"encoder.down.{i}.block.0.conv1.weight")[0] for i in range(levels)),
        "layers_per_block": _count(names, "encoder.down.0.block.", where),
        "decoder_num_layers": _count(names, "decoder.transformer_blocks.", where),
        "decoder_num_attention_heads": dim // HEAD_DIM,
        "decoder_num_register_tokens": need("decoder.register_tokens")[1],
        "decoder_ffn_mult": ff_rows // (2 * dim),
    }


def _original_names(shapes: Mapping[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """diffusers names -> original names, for the shapes the inference reads (q/k/v stacked back)."""
    out = {_rename(name, _BACK): shape for name, shape in shapes.items()}
    for name, shape in shapes.items():
        if match := _Q.match(name):
            out[f"{match.group(1)}.to_qkv.{match.group(2)}"] = (3 * shape[0], *shape[1:])
        elif match := _PROJ.match(name):
            out[f"{match.group(1)}.w1.{match.group(2)}"] = shape
    return out


def _needs(names: Mapping[str, tuple[int, ...]], where: str):
    def need(name: str) -> tuple[int, ...]:
        """The shape of `name`: at least 2-D with no empty dimension (what the config is read from)."""
        if name not in names:
            raise CheckpointError(f"{where} has no tensor {name}; it is not a whole H3 video VAE (download it again)")
        shape = names[name]
        if len(shape) < 2 or not all(shape):
            raise CheckpointError(f"{where}: tensor {name} has shape {list(shape)}; not an H3 video VAE (download it again)")
        return shape

    return need


def _count(names: Mapping[str, object], under: str, where: str) -> int:
    """How many `<under><i>.…` there are, numbered 0..n-1 (`h3core.checkpoints.numbered`: no number is trusted)."""
    try:
        indices = numbered.indices_under(names, under)
    except numbered.BadIndex as err:
        raise CheckpointError(f"{where}: {err}; not an H3 video VAE") from None
    count = numbered.contiguous_count(indices)
    if count is None:
        raise CheckpointError(f"{where}: {under}{numbered.missing(indices, 1)[0]}.* is missing; not a whole H3 video VAE (download it again)")
    return count


def _check_downsamplers(names: Mapping[str, object], where: str) -> None:
    factors = zip(STRUCTURE["spatial_downsample_factors"], STRUCTURE["temporal_downsample_factors"])  # type: ignore[call-overload]
    for level, (space, time) in enumerate(factors):
        has = f"encoder.down.{level}.downsample.conv.weight" in names
        if has != (space * time > 1):
            raise CheckpointError(
                f"{where}: encoder level {level} {'has' if has else 'lacks'} a downsampler; H3's video VAE downsamples at levels 0-3 "
                "(16x space, 4x time); not an H3 video VAE"
            )


def check_structure(config: Mapping[str, object], where: str) -> None:
    """A diffusers config.json describes H3's geometry (the frame and pixel arithmetic depends on it)."""
    wrong = {k: config[k] for k, v in STRUCTURE.items() if k in config and _norm(config[k]) != _norm(v)}
    if config.get("latent_channels", 24) != 24:
        wrong["latent_channels"] = config["latent_channels"]
    if wrong:
        shown = ", ".join(f"{k}={v}" for k, v in wrong.items())
        raise CheckpointError(f"{where}: {shown} is not H3's video VAE structure (24 latent channels, 16x space, 4x time, 17-frame clips)")


def _norm(value: object) -> object:
    return tuple(value) if isinstance(value, (list, tuple)) else value
