"""A Qwen3-VL (or Qwen3) text encoder on disk: which files, which layout, which config, which
tensors of which shapes and quantization -- all settled from safetensors headers (and the tiny
`comfy_quant` markers) before any weight is read.

Layouts, told apart by what the files hold (never by their names):

| kind | path | decoder tensors | beside them (never read) |
|---|---|---|---|
| `comfy` | one `.safetensors` (ComfyUI's `qwen3vl_32b_minimax_h3_nvfp4_awq`) | `model.{embed_tokens,layers.N.*}`, `comfy_quant` markers and/or `visual.*` | `visual.*` |
| `qwen3-vl` | a folder (`text_encoder/` with its index and shards, or the folder above it holding `text_encoder/` and `tokenizer/`), or one file | `model.language_model.{embed_tokens,layers.N.*,norm}` | `model.visual.*`, `lm_head.*` |
| `qwen3` | a folder or file of a plain Qwen3 | `model.{embed_tokens,layers.N.*,norm}` | `lm_head.*` |
| `synthetic` | h3's synthetic file (`__metadata__["format"]`) | as `comfy` | |

Per linear, three storages: Comfy NVFP4 (its marker says `nvfp4`; `h3core.nvfp4.comfy`), ModelOpt
NVFP4 (uint8 `weight` with a row-major `weight_scale`, no marker; `h3core.nvfp4.io`), or dense
float. The token embedding is dense float or Comfy `int8_tensorwise` (per-row scales). A marker of
any other format is refused by name.

Config: a folder's `config.json` (checked field by field against the shapes); a single file's
header config (h3's synthetic files); otherwise the shapes, with the family's RoPE base and
epsilon. A checkpoint without its final norm is truncated: its output layer is its last layer.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping

from h3core.errors import CheckpointError
from h3core.files.paths import path_kind
from h3core.files.safetensors import FLOAT_DTYPE_NAMES, INDEX_FILE, SafetensorsReader
from h3core.nvfp4 import comfy, layout
from h3core.text.config import (
    QWEN3_RMS_NORM_EPS,
    QWEN3_ROPE_THETA,
    QWEN3_VL_ROPE_THETA,
    Qwen3TextConfig,
    merge_config,
    raw_config_json,
    raw_metadata_config,
    text_fields,
)

CONFIG_FILE = "config.json"
WEIGHTS_FOLDER = "text_encoder"
"""The official layout's folder of text-encoder shards (`FL2VA/text_encoder/`)."""

PROCESSOR_FOLDER = "processor"
"""The official layout's folder of the image processor's config, beside `tokenizer/` (`FL2VA/processor/`)."""

SYNTHETIC_FORMAT = "h3-synthetic-text-encoder"
"""`__metadata__["format"]` of h3's synthetic text-encoder files."""

METADATA_CONFIG = "config"
"""`__metadata__` key of a single file's own config (a Hugging Face text config, JSON)."""

ATTENTION_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_LINEARS = ("gate_proj", "up_proj", "down_proj")

VL_PREFIX, PLAIN_PREFIX = "model.language_model.", "model."
EMBEDDING = "embed_tokens"

LINEAR_KINDS = ("nvfp4-comfy", "nvfp4-modelopt", "dense")


@dataclass(frozen=True)
class TextCheckpoint:
    """Where a text encoder's files are: the safetensors files, and for a folder, where its config
    and tokenizer may be."""

    path: Path
    """What the user gave."""

    files: list[Path]
    folder: Path | None = None
    """The weights folder (folder checkpoints only): `config.json` is read from it."""

    tokenizer_folders: list[Path] = field(default_factory=list)
    """Where a folder checkpoint's tokenizer may be, in order (empty: a single file)."""

    processor_folders: list[Path] = field(default_factory=list)
    """Where a folder checkpoint's `preprocessor_config.json` may be, in order (empty: a single file)."""

    @property
    def bytes_on_disk(self) -> int:
        return sum(f.stat().st_size for f in self.files)


def locate(path: Path) -> TextCheckpoint:
    """The files of the text encoder at `path` (a `.safetensors` file or a folder)."""
    if path.is_file():
        if path.suffix != ".safetensors":
            raise CheckpointError(f"text encoder {path} is not a .safetensors file; pass the file or its folder")
        return TextCheckpoint(path, [path])
    if path.is_dir():
        nested = path / WEIGHTS_FOLDER
        if nested.is_dir() and not any(path.glob("*.safetensors")):  # the official folder: FL2VA/
            return TextCheckpoint(path, _shards(nested), nested, [path / "tokenizer", nested], [path / PROCESSOR_FOLDER, nested])
        return TextCheckpoint(path, _shards(path), path, [path, path.parent / "tokenizer"], [path.parent / PROCESSOR_FOLDER, path])
    kind = path_kind(path, follow=True)
    what = "does not exist" if kind == "nothing" else f"is {kind}, not a file or folder"
    raise CheckpointError(
        f"text encoder not found: {path} {what}; set H3_TEXT_ENCODER_PATH (or --text-encoder) "
        "to a .safetensors file or a folder of shards"
    )


def _shards(folder: Path) -> list[Path]:
    """The shards `model.safetensors.index.json` names (each must exist), else every `*.safetensors`."""
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            names = dict.fromkeys(json.loads(index.read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            raise CheckpointError(f"{index} is not a safetensors index ({err}); download it again") from None
        missing = [n for n in names if not (folder / n).is_file()]
        if missing:
            raise CheckpointError(f"{index} names shard {missing[0]}, which is not in {folder}: the download is incomplete")
        return [folder / n for n in names]
    shards = sorted(folder.glob("*.safetensors"))
    if not shards:
        raise CheckpointError(f"text encoder folder {folder} holds no .safetensors file")
    return shards


def identify(reader: SafetensorsReader, where: Path) -> tuple[str, str]:
    """`(kind, prefix of the decoder's tensors)`, from the names and the header metadata."""
    names = set(reader.keys())
    if reader.metadata.get("format") == SYNTHETIC_FORMAT:
        return "synthetic", PLAIN_PREFIX
    if f"{VL_PREFIX}{EMBEDDING}.weight" in names:
        return "qwen3-vl", VL_PREFIX
    if f"{PLAIN_PREFIX}{EMBEDDING}.weight" in names:
        comfy_like = comfy.LEGACY_METADATA in reader.metadata or any(
            n.startswith("visual.") or n.endswith(f".{comfy.MARKER}") for n in names
        )
        return ("comfy" if comfy_like else "qwen3"), PLAIN_PREFIX
    sample = ", ".join(sorted(names)[:3]) or "no tensors"
    raise CheckpointError(
        f"{where} is not a Qwen3-VL / Qwen3 text encoder: no {PLAIN_PREFIX}{EMBEDDING}.weight or "
        f"{VL_PREFIX}{EMBEDDING}.weight (it holds {sample}, ...)"
    )


VISION_PREFIXES = {"comfy": "visual.", "synthetic": "visual.", "qwen3-vl": "model.visual."}
"""Where each layout keeps Qwen3-VL's vision tower (plain Qwen3 has none)."""


def vision_prefix(reader: SafetensorsReader, kind: str) -> str | None:
    """The prefix of the vision tower's tensors when the checkpoint holds one (from the names only)."""
    prefix = VISION_PREFIXES.get(kind)
    if prefix is None or not any(name.startswith(prefix) for name in reader.keys()):
        return None
    return prefix


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


# --- markers ---------------------------------------------------------------------------------------


class Markers:
    """The `comfy_quant` markers of a reader's modules: `<module>.comfy_quant` tensors, or the
    header's `_quantization_metadata` of older files. Read (tiny) only when asked for."""

    def __init__(self, reader: SafetensorsReader):
        self.reader = reader
        self.from_metadata = comfy.markers_of({}, reader.metadata, str(reader.paths[0]))
        self._parsed: dict[str, comfy.ComfyQuant | None] = {}

    def __call__(self, module: str) -> comfy.ComfyQuant | None:
        if module not in self._parsed:
            self._parsed[module] = self._read(module) if f"{module}.{comfy.MARKER}" in self.reader else self.from_metadata.get(module)
        return self._parsed[module]

    def _read(self, module: str) -> comfy.ComfyQuant:
        name = f"{module}.{comfy.MARKER}"
        if self.reader.dtype_name(name) != "U8" or len(self.reader.shape(name)) != 1:
            raise CheckpointError(f"{name} in {self.reader.file_of(name)} is {self.reader.dtype_name(name)} {list(self.reader.shape(name))}, a marker is U8 bytes")
        return comfy.parse_marker(self.reader.get(name).numpy().tobytes(), name)


def linear_kind(reader: SafetensorsReader, markers: Markers, linear: str) -> str:
    """How linear `linear` is stored: one of `LINEAR_KINDS`."""
    quant = markers(linear)
    if quant is not None:
        if quant.format != comfy.NVFP4:
            known = "" if quant.format in comfy.KNOWN_FORMATS else ", a format h3 does not know"
            raise CheckpointError(
                f"{linear} is quantized as {quant.format!r}{known}; h3 reads a text encoder's linears as nvfp4 or "
                "unquantized (int8_tensorwise only for the token embedding): use the NVFP4 export"
            )
        if reader.dtype_name(f"{linear}.weight") != "U8":
            raise CheckpointError(f"{linear}.comfy_quant says nvfp4 but {linear}.weight is {reader.dtype_name(f'{linear}.weight')}; the file is corrupt")
        return "nvfp4-comfy"
    return "nvfp4-modelopt" if f"{linear}.weight_scale" in reader else "dense"


def embedding_quant(markers: Markers, prefix: str) -> comfy.ComfyQuant | None:
    """The token embedding's marker (None: a float table); int8_tensorwise is the only one read."""
    quant = markers(f"{prefix}{EMBEDDING}")
    if quant is not None and quant.format != comfy.INT8_TENSORWISE:
        raise CheckpointError(
            f"{prefix}{EMBEDDING} is quantized as {quant.format!r}; h3 reads a token embedding as a float "
            "table or int8_tensorwise"
        )
    return quant


# --- config ----------------------------------------------------------------------------------------


def linear_shape(reader: SafetensorsReader, linear: str) -> tuple[int, int]:
    """`(out, in)` of a linear from its `weight` header (NVFP4: two codes per byte; Comfy rows padded to 16)."""
    weight = require(reader, f"{linear}.weight")
    if len(weight) != 2:
        raise CheckpointError(f"{linear}.weight has shape {list(weight)}; a linear weight is 2-D")
    out, width = weight
    return (out, layout.unpacked_width(width)) if reader.dtype_name(f"{linear}.weight") == "U8" else (out, width)


def require(reader: SafetensorsReader, name: str) -> tuple[int, ...]:
    if name not in reader:
        raise CheckpointError(f"text encoder checkpoint lacks tensor {name}")
    return reader.shape(name)


def infer_fields(reader: SafetensorsReader, prefix: str, where: Path) -> dict[str, object]:
    """The config fields the tensor shapes determine (from the embedding and layer 0)."""
    embed = require(reader, f"{prefix}{EMBEDDING}.weight")
    if len(embed) != 2:
        raise CheckpointError(f"{prefix}{EMBEDDING}.weight has shape {list(embed)}; expected [vocab, hidden]")
    layer = f"{prefix}layers.0."
    q_norm = require(reader, f"{layer}self_attn.q_norm.weight")
    head_dim = q_norm[0] if len(q_norm) == 1 else 0
    q_out, _ = linear_shape(reader, f"{layer}self_attn.q_proj")
    k_out, _ = linear_shape(reader, f"{layer}self_attn.k_proj")
    if head_dim <= 0 or q_out % head_dim or k_out % head_dim:
        raise CheckpointError(
            f"{layer}self_attn: q_norm {list(q_norm)} does not divide q_proj ({q_out} rows) and "
            f"k_proj ({k_out} rows) into heads"
        )
    gate_out, _ = linear_shape(reader, f"{layer}mlp.gate_proj")
    return {
        "vocab_size": embed[0],
        "hidden_size": embed[1],
        "num_layers": layer_count(reader.keys(), prefix, where),
        "head_dim": head_dim,
        "num_heads": q_out // head_dim,
        "num_kv_heads": k_out // head_dim,
        "intermediate_size": gate_out,
        "attention_bias": f"{layer}self_attn.q_proj.bias" in reader,
    }


def resolve_config(
    reader: SafetensorsReader, prefix: str, kind: str, checkpoint: TextCheckpoint
) -> tuple[Qwen3TextConfig, str]:
    """The decoder's config and where it came from, checked against the shapes."""
    inferred = infer_fields(reader, prefix, checkpoint.path)
    defaults = {
        "rope_theta": QWEN3_ROPE_THETA if kind == "qwen3" else QWEN3_VL_ROPE_THETA,
        "rms_norm_eps": QWEN3_RMS_NORM_EPS,
    }
    raw, source = stated_config(reader, checkpoint)
    stated = text_fields(raw, Path(source.removesuffix(" (header)"))) if raw is not None else {}
    return merge_config(stated, inferred, stated_in=source, defaults=defaults), source


def stated_config(reader: SafetensorsReader, checkpoint: TextCheckpoint) -> tuple[dict | None, str]:
    """The Hugging Face config the files state, parsed, and where: a folder's `config.json`, else a
    single file's header config; `(None, "inferred from tensor shapes")` when neither exists."""
    config_path = checkpoint.folder / CONFIG_FILE if checkpoint.folder is not None else None
    if config_path is not None and config_path.is_file():
        return raw_config_json(config_path), str(config_path)
    if METADATA_CONFIG in reader.metadata:
        where = str(checkpoint.files[0])
        return raw_metadata_config(reader.metadata[METADATA_CONFIG], where), f"{where} (header)"
    return None, "inferred from tensor shapes"


# --- tensors ---------------------------------------------------------------------------------------


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


def check_tensors(reader: SafetensorsReader, markers: Markers, prefix: str, config: Qwen3TextConfig, layers: int) -> set[str]:
    """Every tensor the embedding and the first `layers` layers need exists with the shape, dtype
    and quantization the config implies; one `CheckpointError` naming the first that does not.
    Returns the kinds of linear found (`LINEAR_KINDS`)."""
    _check_embedding(reader, markers, prefix, config)
    kinds: set[str] = set()
    for index in range(layers):
        layer = f"{prefix}layers.{index}."
        for name, shape in expected_vector_shapes(config).items():
            check_shape(reader, layer + name, shape, FLOAT_DTYPE_NAMES)
        for name, (out, inp) in expected_linear_shapes(config).items():
            bias = config.attention_bias and name.startswith("self_attn")
            kinds.add(_check_linear(reader, markers, layer + name, out, inp, bias))
    return kinds


def _check_embedding(reader: SafetensorsReader, markers: Markers, prefix: str, config: Qwen3TextConfig) -> None:
    module = f"{prefix}{EMBEDDING}"
    quant = embedding_quant(markers, prefix)
    if quant is None:
        check_shape(reader, f"{module}.weight", (config.vocab_size, config.hidden_size), FLOAT_DTYPE_NAMES)
    else:
        comfy.check_int8_headers(reader, module, config.vocab_size, config.hidden_size, quant)


def _check_linear(reader: SafetensorsReader, markers: Markers, linear: str, out: int, inp: int, bias: bool) -> str:
    kind = linear_kind(reader, markers, linear)
    if kind == "nvfp4-comfy":
        comfy.check_nvfp4_headers(reader, linear, out, inp)
    elif kind == "nvfp4-modelopt":
        check_shape(reader, f"{linear}.weight", (out, layout.packed_columns(inp)), ("U8",))
        check_shape(reader, f"{linear}.weight_scale", (out, layout.scale_columns(inp)), ("F8_E4M3",))
        if f"{linear}.pre_quant_scale" in reader:
            check_shape(reader, f"{linear}.pre_quant_scale", (inp,), FLOAT_DTYPE_NAMES)
    else:
        check_shape(reader, f"{linear}.weight", (out, inp), FLOAT_DTYPE_NAMES)
    if bias:
        check_shape(reader, f"{linear}.bias", (out,), FLOAT_DTYPE_NAMES)
    return kind


def check_shape(reader: SafetensorsReader, name: str, shape: tuple[int, ...], dtypes: tuple[str, ...]) -> None:
    actual = require(reader, name)
    if actual != shape:
        raise CheckpointError(
            f"{name} in {reader.file_of(name)} has shape {list(actual)} but the text encoder config "
            f"needs {list(shape)}; the checkpoint is inconsistent"
        )
    dtype = reader.dtype_name(name)
    if dtype not in dtypes:
        raise CheckpointError(f"{name} in {reader.file_of(name)} is {dtype}; expected {'/'.join(dtypes)} {list(shape)}")


def has_final_norm(reader: SafetensorsReader, prefix: str) -> bool:
    """A checkpoint with its final norm holds the whole decoder; without it, it was cut after its last layer."""
    return f"{prefix}norm.weight" in reader


def config_metadata(fields: Mapping[str, object], vision: Mapping[str, object] | None = None) -> str:
    """A Hugging Face config (JSON) of our config fields, for a single file's header: the text
    config, or with `vision` (our vision fields) a Qwen3-VL config holding both, which transformers'
    `Qwen3VLConfig(**json.loads(...))` also builds."""
    text: dict[str, object] = {
        "model_type": "qwen3_vl_text", "vocab_size": fields["vocab_size"], "hidden_size": fields["hidden_size"],
        "num_hidden_layers": fields["num_layers"], "num_attention_heads": fields["num_heads"],
        "num_key_value_heads": fields["num_kv_heads"], "head_dim": fields["head_dim"],
        "intermediate_size": fields["intermediate_size"], "rms_norm_eps": fields["rms_norm_eps"],
        "rope_theta": fields["rope_theta"], "attention_bias": fields["attention_bias"], "hidden_act": "silu",
    }
    if fields.get("mrope_section") is not None:
        text["rope_parameters"] = {
            "rope_type": "default", "rope_theta": fields["rope_theta"], "mrope_section": list(fields["mrope_section"]),  # type: ignore[call-overload]
            "mrope_interleaved": fields.get("mrope_interleaved", True),
        }
    if vision is None:
        return json.dumps(text, sort_keys=True)
    vision_config = {k: (list(v) if isinstance(v, tuple) else v) for k, v in vision.items() if k != "rope_theta"}
    vision_config |= {"model_type": "qwen3_vl_vision", "rope_parameters": {"rope_type": "axial", "rope_theta": vision["rope_theta"]}}
    return json.dumps({"model_type": "qwen3_vl", "text_config": text, "vision_config": vision_config, "tie_word_embeddings": False}, sort_keys=True)
