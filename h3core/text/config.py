"""Dimensions of a Qwen3 text decoder, read from `config.json`, inferred from tensor shapes, and
checked against each other.

Hugging Face writes two kinds of `config.json` for the models h3 reads:

- plain Qwen3 (`model_type: qwen3`): the fields at the top level;
- Qwen3-VL (`model_type: qwen3_vl`): the language model's fields under `text_config`, next to a
  `vision_config` h3 never uses.

The RoPE base appears as `rope_theta` at the top level (transformers 4.x) or inside
`rope_parameters` (transformers 5.x; `rope_scaling` in 4.x holds only the type and Qwen3-VL's
`mrope_section`). Only the default RoPE type is implemented: scaled variants (yarn, linear,
dynamic) are refused with a clear error rather than silently computed wrong.

Qwen3-VL's `vision_config` (the vision tower, read only for keyframes) is `Qwen3VisionConfig`; its
fields come from the same file and from the tower's tensor shapes (`vision_checkpoint.py`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Mapping

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from h3core.errors import CheckpointError

QWEN3_ROPE_THETA = 1_000_000.0
"""RoPE base of every Qwen3 text model; used when a checkpoint has no config.json."""

QWEN3_VL_ROPE_THETA = 5_000_000.0
"""RoPE base of every Qwen3-VL language model; used when a checkpoint has no config.json."""

QWEN3_RMS_NORM_EPS = 1e-6
"""RMSNorm epsilon of Qwen3 and Qwen3-VL; used when a checkpoint has no config.json."""

H3_OUTPUT_LAYER = 50
"""The hidden state MiniMax-H3 conditions on: Hugging Face's `hidden_states[50]`, the output of
decoder layer 50 (index 49) of Qwen3-VL-32B's 64, before any norm (diffusers 0.42.1
`MiniMaxH3ModularPipeline.text_encoder_layer`; ComfyUI's NVFP4 file keeps exactly layers 0..49).
The default output layer of a checkpoint that holds the whole decoder (its final norm included);
a truncated one (no final norm) outputs its last layer."""


class Qwen3TextConfig(BaseModel):
    """The numbers that fix the shape and the arithmetic of a Qwen3 decoder's text path."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    vocab_size: int = Field(gt=0, description="Rows of the token embedding table.")
    hidden_size: int = Field(gt=0, description="Width of the residual stream (Qwen3-VL-32B: 5120).")
    num_layers: int = Field(gt=0, description="Decoder layers in the checkpoint.")
    num_heads: int = Field(gt=0, description="Query heads.")
    num_kv_heads: int = Field(gt=0, description="Key/value heads (GQA: each serves num_heads/num_kv_heads queries).")
    head_dim: int = Field(gt=0, description="Width of one head; even (RoPE rotates pairs).")
    intermediate_size: int = Field(gt=0, description="SwiGLU width: gate_proj and up_proj are [intermediate, hidden].")
    rope_theta: float = Field(gt=0, description="RoPE base.")
    rms_norm_eps: float = Field(gt=0, description="Epsilon of every RMSNorm (layer, q/k and final norms).")
    attention_bias: bool = Field(False, description="Whether q/k/v/o projections carry a bias.")
    mrope_section: tuple[int, int, int] | None = Field(
        None,
        description="Qwen3-VL's multimodal RoPE: how many of the head's head_dim/2 frequency slots follow the time, "
        "height and width positions (`mrope_section`); None when the files do not say (see `mrope_sections`).",
    )
    mrope_interleaved: bool = Field(True, description="Slots assigned round-robin t, h, w (Qwen3-VL) rather than in three runs.")

    @model_validator(mode="after")
    def _check(self) -> "Qwen3TextConfig":
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.num_heads} query heads do not divide into {self.num_kv_heads} key/value heads")
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even for RoPE")
        if self.mrope_section is not None and sum(self.mrope_section) != self.head_dim // 2:
            raise ValueError(f"mrope_section {list(self.mrope_section)} does not add up to head_dim / 2 = {self.head_dim // 2}")
        return self


QWEN3_VL_MROPE_SECTION = (24, 20, 20)
"""Qwen3-VL's multimodal RoPE split of a 128-wide head's 64 frequency slots (time, height, width)."""


def mrope_sections(config: Qwen3TextConfig) -> tuple[int, int, int] | None:
    """The M-RoPE split image tokens need: the stated one, Qwen3-VL's for a 128-wide head, else None."""
    if config.mrope_section is not None:
        return config.mrope_section
    return QWEN3_VL_MROPE_SECTION if config.head_dim == 2 * sum(QWEN3_VL_MROPE_SECTION) else None


class Qwen3VisionConfig(BaseModel):
    """Qwen3-VL's vision tower (transformers' `Qwen3VLVisionConfig` names)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    depth: int = Field(gt=0, description="Vision blocks (H3: 27).")
    hidden_size: int = Field(gt=0, description="Width of the blocks (H3: 1152).")
    num_heads: int = Field(gt=0, description="Attention heads of a block (H3: 16 of 72).")
    intermediate_size: int = Field(gt=0, description="Width of a block's MLP (H3: 4304).")
    in_channels: int = Field(3, gt=0, description="Colour channels of a patch.")
    patch_size: int = Field(gt=0, description="Side of a patch in pixels (H3: 16).")
    temporal_patch_size: int = Field(gt=0, description="Frames in a patch (H3: 2; an image is repeated).")
    spatial_merge_size: int = Field(gt=0, description="Patches merged per side into one language token (H3: 2).")
    out_hidden_size: int = Field(gt=0, description="Width of a merged token: the language model's hidden size.")
    num_position_embeddings: int = Field(gt=0, description="Rows of the learned position table, a square grid (H3: 2304 = 48 x 48).")
    deepstack_visual_indexes: tuple[int, ...] = Field(description="Blocks whose output a deepstack merger reads (H3: 8, 16, 24).")
    hidden_act: str = Field("gelu_pytorch_tanh", description="Activation of a block's MLP: gelu_pytorch_tanh or gelu.")
    rope_theta: float = Field(10_000.0, gt=0, description="Base of the blocks' 2-D rotary embedding.")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def grid_side(self) -> int:
        """Side of the learned position grid."""
        return math.isqrt(self.num_position_embeddings)

    @model_validator(mode="after")
    def _check(self) -> "Qwen3VisionConfig":
        if self.hidden_size % self.num_heads or self.head_dim % 4:
            raise ValueError(f"width {self.hidden_size} does not split into {self.num_heads} heads of a multiple of 4 (2-D RoPE)")
        if self.grid_side**2 != self.num_position_embeddings:
            raise ValueError(f"num_position_embeddings {self.num_position_embeddings} is not a square grid")
        if len(set(self.deepstack_visual_indexes)) != len(self.deepstack_visual_indexes) or not all(
            0 <= i < self.depth for i in self.deepstack_visual_indexes
        ):
            raise ValueError(f"deepstack_visual_indexes {list(self.deepstack_visual_indexes)} are not distinct blocks of 0..{self.depth - 1}")
        if self.hidden_act not in VISION_ACTIVATIONS:
            raise ValueError(f"hidden_act {self.hidden_act!r} is not one of {', '.join(VISION_ACTIVATIONS)}")
        return self


VISION_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu")
"""The MLP activations h3's vision blocks implement (Qwen3-VL uses the first)."""


# Hugging Face field name -> ours. `head_dim` may be absent (then it comes from the q_norm shape).
_HF_FIELDS = {
    "vocab_size": "vocab_size",
    "hidden_size": "hidden_size",
    "num_hidden_layers": "num_layers",
    "num_attention_heads": "num_heads",
    "num_key_value_heads": "num_kv_heads",
    "head_dim": "head_dim",
    "intermediate_size": "intermediate_size",
    "rms_norm_eps": "rms_norm_eps",
    "attention_bias": "attention_bias",
}

_SUPPORTED_MODEL_TYPES = ("qwen3", "qwen3_vl", "qwen3_vl_text")


def read_metadata_config(text: str, where: str) -> dict[str, Any]:
    """The text-decoder fields a single file states in its header (`__metadata__["config"]`, a
    Hugging Face Qwen3-VL or text config as JSON: h3's synthetic encoder writes one)."""
    return text_fields(raw_metadata_config(text, where), Path(where))


def raw_metadata_config(text: str, where: str) -> dict[str, Any]:
    """A single file's header config, parsed."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{where}: the header's config is not JSON ({exc}); the file is corrupt") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{where}: the header's config is not a JSON object; the file is corrupt")
    return raw


def read_config_json(path: Path) -> dict[str, Any]:
    """The text-decoder fields (our names) that `config.json` at `path` states."""
    return text_fields(raw_config_json(path), path)


def raw_config_json(path: Path) -> dict[str, Any]:
    """`config.json` at `path`, parsed."""
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"cannot read {path}: {exc}; fix or remove it (h3 then infers the config from shapes)") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path} is not a JSON object; fix or remove it")
    return raw


def text_fields(raw: Mapping[str, Any], path: Path) -> dict[str, Any]:
    """Our fields from a parsed Hugging Face config (plain Qwen3 or Qwen3-VL's `text_config`)."""
    model_type = raw.get("model_type")
    if model_type is not None and model_type not in _SUPPORTED_MODEL_TYPES:
        raise CheckpointError(
            f"{path} describes a {model_type!r} model; h3's text encoder runs dense Qwen3 / Qwen3-VL "
            f"decoders ({', '.join(_SUPPORTED_MODEL_TYPES)})"
        )
    text = raw.get("text_config", raw)
    if not isinstance(text, Mapping):
        raise CheckpointError(f"{path}: text_config is not an object")
    _check_unsupported(text, path)
    fields = {ours: text[hf] for hf, ours in _HF_FIELDS.items() if text.get(hf) is not None}
    theta = _rope_theta(text)
    if theta is not None:
        fields["rope_theta"] = float(theta)
    rope = _rope_parameters(text)
    if rope.get("mrope_section") is not None:
        fields["mrope_section"] = tuple(rope["mrope_section"])
    if rope.get("mrope_interleaved") is not None:
        fields["mrope_interleaved"] = bool(rope["mrope_interleaved"])
    return fields


_VISION_FIELDS = tuple(Qwen3VisionConfig.model_fields)


def vision_fields(raw: Mapping[str, Any], path: Path) -> dict[str, Any]:
    """Our vision fields from a parsed Qwen3-VL config's `vision_config` (empty when it has none)."""
    vision = raw.get("vision_config")
    if vision is None:
        return {}
    if not isinstance(vision, Mapping):
        raise CheckpointError(f"{path}: vision_config is not an object")
    fields = {name: vision[name] for name in _VISION_FIELDS if vision.get(name) is not None and name != "rope_theta"}
    if "deepstack_visual_indexes" in fields:
        fields["deepstack_visual_indexes"] = tuple(fields["deepstack_visual_indexes"])
    rope = vision.get("rope_parameters") or {}
    theta = rope.get("rope_theta", vision.get("rope_theta")) if isinstance(rope, Mapping) else vision.get("rope_theta")
    if theta is not None:
        fields["rope_theta"] = float(theta)
    return fields


def _rope_parameters(text: Mapping[str, Any]) -> Mapping[str, Any]:
    for key in ("rope_parameters", "rope_scaling"):
        value = text.get(key)
        if isinstance(value, Mapping):
            return value
    return {}


def _rope_theta(text: Mapping[str, Any]) -> float | None:
    return _rope_parameters(text).get("rope_theta", text.get("rope_theta"))


def _check_unsupported(text: Mapping[str, Any], path: Path) -> None:
    rope_type = _rope_parameters(text).get("rope_type", _rope_parameters(text).get("type", "default"))
    if rope_type not in ("default", "mrope"):
        raise CheckpointError(
            f"{path}: RoPE type {rope_type!r} is not implemented by h3's text encoder (only the "
            "default, unscaled RoPE); use a checkpoint without RoPE scaling"
        )
    if text.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"{path}: hidden_act {text['hidden_act']!r} is not Qwen3's 'silu'")
    if text.get("use_sliding_window"):
        raise CheckpointError(f"{path}: sliding-window attention is not implemented; set use_sliding_window false")
    if text.get("num_experts") or text.get("num_local_experts"):
        raise CheckpointError(f"{path}: a mixture-of-experts Qwen3 is not supported (dense decoders only)")


def merge_config(
    stated: Mapping[str, Any], inferred: Mapping[str, Any], *, stated_in: str, defaults: Mapping[str, Any]
) -> Qwen3TextConfig:
    """One config from what `config.json` states and what the tensor shapes show.

    A field both give must agree (else one `CheckpointError` naming the field, both values and
    where each came from); fields neither gives take `defaults`.
    """
    for name in stated.keys() & inferred.keys():
        if stated[name] != inferred[name]:
            raise CheckpointError(
                f"{stated_in} says {name} = {stated[name]!r} but the checkpoint's tensors have "
                f"{name} = {inferred[name]!r}; use the config.json that belongs to these weights"
            )
    values = {**defaults, **inferred, **stated}
    try:
        return Qwen3TextConfig(**values)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'config'}: {e['msg']}" for e in exc.errors())
        raise CheckpointError(f"text encoder config ({stated_in}) is not a valid Qwen3 decoder: {problems}") from None
