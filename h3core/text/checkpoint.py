"""A Qwen3 / Qwen3-VL text decoder on disk: which files, which key layout, which config, which
tensors of which shapes -- all settled from safetensors headers before any weight is read.

Accepted layouts (Hugging Face names):

- Qwen3-VL: `model.language_model.{embed_tokens,layers.N.*,norm}`, beside `model.visual.*` and
  `lm_head.*`, which are never read;
- plain Qwen3: `model.{embed_tokens,layers.N.*,norm}` (an `lm_head.*` is never read).

Each linear is either NVFP4 in ModelOpt's names (`weight` uint8, `weight_scale`, `weight_scale_2`,
optional `pre_quant_scale` from AWQ, `input_scale`, `bias`) or unquantized (`weight` float, bf16
kept as bf16). Tensors the text path does not use (ModelOpt's `k_scale`/`v_scale`, rotary
caches) are ignored.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Mapping

from h3core.errors import CheckpointError
from h3core.files.paths import path_kind
from h3core.nvfp4 import layout
from h3core.text.config import (
    QWEN3_RMS_NORM_EPS,
    QWEN3_ROPE_THETA,
    QWEN3_VL_ROPE_THETA,
    Qwen3TextConfig,
    merge_config,
    read_config_json,
)

if TYPE_CHECKING:
    from h3core.files.safetensors import SafetensorsReader

CONFIG_FILE = "config.json"

ATTENTION_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_LINEARS = ("gate_proj", "up_proj", "down_proj")
LAYER_NORMS = ("input_layernorm", "post_attention_layernorm")

# (kind, prefix of the decoder's tensors), most specific first.
LAYOUTS = (("qwen3-vl", "model.language_model."), ("qwen3", "model."))

_FLOAT_DTYPES = {"F32", "F16", "BF16", "F64"}
_NVFP4_MARKER = "weight_scale"


@dataclass(frozen=True)
class TensorHeader:
    """What a safetensors header says about one tensor (no data read)."""

    shape: tuple[int, ...]
    dtype: str  # safetensors' dtype tag: "BF16", "F32", "U8", "F8_E4M3", ...
    file: Path


def checkpoint_files(path: Path) -> list[Path]:
    """The safetensors files of a text-encoder path: the file itself, or every shard in the folder."""
    if path.is_file():
        if path.suffix != ".safetensors":
            raise CheckpointError(f"text encoder {path} is not a .safetensors file; pass the file or its folder")
        return [path]
    if path.is_dir():
        shards = sorted(path.glob("*.safetensors"))
        if not shards:
            raise CheckpointError(f"text encoder folder {path} holds no .safetensors file")
        return shards
    kind = path_kind(path, follow=True)
    what = "does not exist" if kind == "nothing" else f"is {kind}, not a file or folder"
    raise CheckpointError(
        f"text encoder not found: {path} {what}; set H3_TEXT_ENCODER_PATH (or --text-encoder) "
        "to a .safetensors file or a folder of shards"
    )


def read_headers(reader: "SafetensorsReader") -> dict[str, TensorHeader]:
    """Name -> shape and dtype of every tensor the reader's files hold, from their headers only."""
    return {
        name: TensorHeader(reader.shape(name), reader.dtype_name(name), reader.file_of(name)) for name in reader.keys()
    }


def find_layout(names: Iterable[str], where: Path) -> tuple[str, str]:
    """`(kind, prefix)` of the decoder's tensors, found by the embedding's name."""
    names = set(names)
    for kind, prefix in LAYOUTS:
        if f"{prefix}embed_tokens.weight" in names:
            return kind, prefix
    looked_for = " or ".join(f"{prefix}embed_tokens.weight" for _, prefix in LAYOUTS)
    sample = ", ".join(sorted(names)[:3]) or "no tensors"
    raise CheckpointError(
        f"{where} is not a Qwen3 / Qwen3-VL checkpoint: no {looked_for} (it holds {sample}, ...)"
    )


def layer_count(names: Iterable[str], prefix: str, where: Path) -> int:
    """Number of decoder layers; their indices must run 0..n-1 without a gap."""
    pattern = re.compile(re.escape(prefix) + r"layers\.(\d+)\.")
    indices = {int(m.group(1)) for name in names if (m := pattern.match(name))}
    if not indices:
        raise CheckpointError(f"{where} has no decoder layers ({prefix}layers.N.*)")
    missing = sorted(set(range(max(indices) + 1)) - indices)
    if missing:
        raise CheckpointError(f"{where} lacks decoder layer {missing[0]} ({prefix}layers.{missing[0]}.*): truncated or mis-merged shards?")
    return max(indices) + 1


def is_nvfp4(headers: Mapping[str, TensorHeader], linear: str) -> bool:
    return f"{linear}.{_NVFP4_MARKER}" in headers


def linear_shape(headers: Mapping[str, TensorHeader], linear: str) -> tuple[int, int]:
    """`(out, in)` of a linear, NVFP4 (in from its packed byte columns) or dense."""
    weight = require(headers, f"{linear}.weight")
    if len(weight.shape) != 2:
        raise CheckpointError(f"{linear}.weight has shape {list(weight.shape)}; a linear weight is 2-D")
    out, width = weight.shape
    return (out, layout.unpacked_width(width)) if is_nvfp4(headers, linear) else (out, width)


def require(headers: Mapping[str, TensorHeader], name: str) -> TensorHeader:
    try:
        return headers[name]
    except KeyError:
        raise CheckpointError(f"text encoder checkpoint lacks tensor {name}") from None


def infer_fields(headers: Mapping[str, TensorHeader], prefix: str, where: Path) -> dict[str, object]:
    """The config fields the tensor shapes determine (from the embedding and layer 0)."""
    embed = require(headers, f"{prefix}embed_tokens.weight").shape
    if len(embed) != 2:
        raise CheckpointError(f"{prefix}embed_tokens.weight has shape {list(embed)}; expected [vocab, hidden]")
    layer = f"{prefix}layers.0."
    q_norm = require(headers, f"{layer}self_attn.q_norm.weight").shape
    head_dim = q_norm[0] if len(q_norm) == 1 else 0
    q_out, _ = linear_shape(headers, f"{layer}self_attn.q_proj")
    k_out, _ = linear_shape(headers, f"{layer}self_attn.k_proj")
    if head_dim <= 0 or q_out % head_dim or k_out % head_dim:
        raise CheckpointError(
            f"{layer}self_attn: q_norm {list(q_norm)} does not divide q_proj ({q_out} rows) and "
            f"k_proj ({k_out} rows) into heads"
        )
    gate_out, _ = linear_shape(headers, f"{layer}mlp.gate_proj")
    return {
        "vocab_size": embed[0],
        "hidden_size": embed[1],
        "num_layers": layer_count(headers, prefix, where),
        "head_dim": head_dim,
        "num_heads": q_out // head_dim,
        "num_kv_heads": k_out // head_dim,
        "intermediate_size": gate_out,
        "attention_bias": f"{layer}self_attn.q_proj.bias" in headers,
    }


def resolve_config(
    headers: Mapping[str, TensorHeader], prefix: str, kind: str, folder: Path, where: Path
) -> tuple[Qwen3TextConfig, str]:
    """The decoder's config and where it came from: `config.json` checked against the shapes, or
    the shapes alone (RoPE base and epsilon then take the Qwen3 / Qwen3-VL defaults)."""
    inferred = infer_fields(headers, prefix, where)
    defaults = {
        "rope_theta": QWEN3_VL_ROPE_THETA if kind == "qwen3-vl" else QWEN3_ROPE_THETA,
        "rms_norm_eps": QWEN3_RMS_NORM_EPS,
    }
    config_path = folder / CONFIG_FILE
    if config_path.is_file():
        stated = read_config_json(config_path)
        return merge_config(stated, inferred, stated_in=str(config_path), defaults=defaults), str(config_path)
    source = "inferred from tensor shapes"
    return merge_config({}, inferred, stated_in=source, defaults=defaults), source


def expected_linear_shapes(config: Qwen3TextConfig) -> dict[str, tuple[int, int]]:
    """`(out, in)` of every linear of a layer, by its name under the layer."""
    q_width = config.num_heads * config.head_dim
    kv_width = config.num_kv_heads * config.head_dim
    d, f = config.hidden_size, config.intermediate_size
    return {
        "self_attn.q_proj": (q_width, d),
        "self_attn.k_proj": (kv_width, d),
        "self_attn.v_proj": (kv_width, d),
        "self_attn.o_proj": (d, q_width),
        "mlp.gate_proj": (f, d),
        "mlp.up_proj": (f, d),
        "mlp.down_proj": (d, f),
    }


def expected_vector_shapes(config: Qwen3TextConfig) -> dict[str, tuple[int, ...]]:
    """Shapes of a layer's norm weights, by name under the layer."""
    d, dh = config.hidden_size, config.head_dim
    return {
        "input_layernorm.weight": (d,),
        "post_attention_layernorm.weight": (d,),
        "self_attn.q_norm.weight": (dh,),
        "self_attn.k_norm.weight": (dh,),
    }


def check_tensors(
    headers: Mapping[str, TensorHeader], prefix: str, config: Qwen3TextConfig, layers: int, *, final_norm: bool
) -> None:
    """Every tensor the embedding, the first `layers` layers and (if asked) the final norm need
    exists with the shape and kind of dtype the config implies; one `CheckpointError` naming the
    first that does not."""
    _check_shape(headers, f"{prefix}embed_tokens.weight", (config.vocab_size, config.hidden_size), float_only=True)
    if final_norm:
        _check_shape(headers, f"{prefix}norm.weight", (config.hidden_size,), float_only=True)
    for index in range(layers):
        layer = f"{prefix}layers.{index}."
        for name, shape in expected_vector_shapes(config).items():
            _check_shape(headers, layer + name, shape, float_only=True)
        for name, (out, inp) in expected_linear_shapes(config).items():
            _check_linear(headers, layer + name, out, inp, config.attention_bias and name.startswith("self_attn"))


def _check_linear(headers: Mapping[str, TensorHeader], linear: str, out: int, inp: int, bias: bool) -> None:
    if is_nvfp4(headers, linear):
        _check_shape(headers, f"{linear}.weight", (out, layout.packed_columns(inp)), dtype="U8")
        if f"{linear}.pre_quant_scale" in headers:
            _check_shape(headers, f"{linear}.pre_quant_scale", (inp,), float_only=True)
    else:
        _check_shape(headers, f"{linear}.weight", (out, inp), float_only=True)
    if bias:
        _check_shape(headers, f"{linear}.bias", (out,), float_only=True)


def _check_shape(
    headers: Mapping[str, TensorHeader],
    name: str,
    shape: tuple[int, ...],
    *,
    float_only: bool = False,
    dtype: str | None = None,
) -> None:
    header = require(headers, name)
    if header.shape != shape:
        raise CheckpointError(
            f"{name} in {header.file} has shape {list(header.shape)} but the text encoder config "
            f"needs {list(shape)}; the checkpoint is inconsistent"
        )
    if float_only and header.dtype not in _FLOAT_DTYPES:
        raise CheckpointError(f"{name} in {header.file} has dtype {header.dtype}; expected a float tensor (F32/BF16/F16)")
    if dtype is not None and header.dtype != dtype:
        raise CheckpointError(f"{name} in {header.file} has dtype {header.dtype}; an NVFP4 weight is packed {dtype}")
