"""Qwen3-VL's vision tower on disk: its config and its tensors, settled from headers before a weight
is read -- and only for a request with keyframes (a text-only request never looks at them).

Names under the tower's prefix (`visual.` in ComfyUI's file and h3's synthetic one, `model.visual.`
in the official / Hugging Face folder), all dense float (bf16 in H3's files):

| tensor | shape |
|---|---|
| `patch_embed.proj.weight`, `.bias` | `[D, C, T, P, P]` (a Conv3d with stride = kernel), `[D]` |
| `pos_embed.weight` | `[G*G, D]` (H3: 2304 = 48 x 48) |
| `blocks.N.{norm1,norm2}.{weight,bias}` | `[D]` |
| `blocks.N.attn.qkv.{weight,bias}`, `blocks.N.attn.proj.*` | `[3D, D]`, `[3D]`; `[D, D]`, `[D]` |
| `blocks.N.mlp.linear_fc1.*`, `blocks.N.mlp.linear_fc2.*` | `[I, D]`, `[I]`; `[D, I]`, `[D]` |
| `merger.norm.*` | `[D]` |
| `deepstack_merger_list.K.norm.*` | `[D*m*m]` (the norm after the 2x2 shuffle) |
| `{merger,deepstack_merger_list.K}.linear_fc1.*`, `.linear_fc2.*` | `[Dm², Dm²]`, `[Dm²]`; `[out, Dm²]`, `[out]` |

Config: the folder's `config.json` `vision_config` or a single file's header config, checked field
by field against the shapes. The shapes give every width, the depth, the patch and merge sizes and
the number of deepstack mergers; they cannot give the head count or which blocks the deepstack
mergers read. A file that states neither (ComfyUI's) gets H3's tower's values (16 heads,
blocks 8, 16, 24) when its shapes are H3's tower (27 blocks of 1152, 3 deepstack mergers), and is
refused otherwise with a line saying what to add.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from pydantic import ValidationError

from h3core.errors import CheckpointError, KeyframeError
from h3core.files.safetensors import FLOAT_DTYPE_NAMES, SafetensorsReader
from h3core.text.checkpoint import VISION_PREFIXES, Markers, TextCheckpoint, check_shape, require, stated_config, vision_prefix
from h3core.text.config import Qwen3TextConfig, Qwen3VisionConfig, mrope_sections, vision_fields
from h3core.text.image_processor import ImageProcessor, read_processor_config

H3_VISION_SHAPES = {"hidden_size": 1152, "depth": 27, "deepstack_mergers": 3}
"""What the tensors of H3's (Qwen3-VL-32B's) vision tower show."""

H3_VISION_STATED = {"num_heads": 16, "deepstack_visual_indexes": (8, 16, 24), "hidden_act": "gelu_pytorch_tanh", "rope_theta": 10_000.0}
"""What H3's `FL2VA/text_encoder/config.json` states of its vision tower beyond the shapes."""

BLOCK_LINEARS = ("attn.qkv", "attn.proj", "mlp.linear_fc1", "mlp.linear_fc2")
MERGER_LINEARS = ("linear_fc1", "linear_fc2")


def infer_vision_fields(reader: SafetensorsReader, prefix: str, where: Path) -> dict[str, Any]:
    """The vision config fields the tensor shapes determine, and `deepstack_mergers` (their count)."""
    patch = require(reader, f"{prefix}patch_embed.proj.weight")
    if len(patch) != 5 or patch[3] != patch[4]:
        raise CheckpointError(f"{prefix}patch_embed.proj.weight has shape {list(patch)}; expected [width, channels, frames, patch, patch]")
    hidden, channels, frames, side = patch[0], patch[1], patch[2], patch[3]
    positions = require(reader, f"{prefix}pos_embed.weight")
    fc1 = require(reader, f"{prefix}blocks.0.mlp.linear_fc1.weight")
    merged_in = require(reader, f"{prefix}merger.linear_fc1.weight")[-1]
    merge = math.isqrt(merged_in // hidden) if merged_in % hidden == 0 else 0
    if merge * merge * hidden != merged_in:
        raise CheckpointError(f"{prefix}merger.linear_fc1 takes {merged_in} features, not width {hidden} times a square merge")
    return {
        "hidden_size": hidden, "in_channels": channels, "temporal_patch_size": frames, "patch_size": side,
        "num_position_embeddings": positions[0], "intermediate_size": fc1[0], "spatial_merge_size": merge,
        "out_hidden_size": require(reader, f"{prefix}merger.linear_fc2.weight")[0],
        "depth": _count(reader, f"{prefix}blocks.", where), "deepstack_mergers": _count(reader, f"{prefix}deepstack_merger_list.", where, 0),
    }


def _count(reader: SafetensorsReader, prefix: str, where: Path, least: int = 1) -> int:
    """How many `prefix<N>.` modules there are; their indices must run 0..n-1."""
    pattern = re.compile(re.escape(prefix) + r"(\d+)\.")
    indices = {int(m.group(1)) for name in reader.keys() if (m := pattern.match(name))}
    count = max(indices) + 1 if indices else 0
    missing = sorted(set(range(count)) - indices)
    if count < least or missing:
        raise CheckpointError(f"{where} lacks {prefix}{missing[0] if missing else 0}.*: the vision tower is incomplete")
    return count


def resolve_vision_config(
    reader: SafetensorsReader, prefix: str, stated_raw: Mapping[str, Any] | None, stated_in: str, *, text_hidden: int, where: Path
) -> Qwen3VisionConfig:
    """The vision tower's config: what the files state, checked against the shapes (see the module docstring)."""
    inferred = infer_vision_fields(reader, prefix, where)
    mergers = inferred.pop("deepstack_mergers")
    stated = vision_fields(stated_raw, Path(stated_in)) if stated_raw is not None else {}
    for name in stated.keys() & inferred.keys():
        if stated[name] != inferred[name]:
            raise CheckpointError(
                f"{stated_in} says vision {name} = {stated[name]!r} but the vision tower's tensors have {inferred[name]!r}; "
                "use the config that belongs to these weights"
            )
    values = {**inferred, **stated}
    if "num_heads" not in values or "deepstack_visual_indexes" not in values:
        values = _h3_defaults(values, mergers, where)
    if len(values["deepstack_visual_indexes"]) != mergers:
        raise CheckpointError(
            f"{stated_in} names {len(values['deepstack_visual_indexes'])} deepstack layers but {where} has {mergers} deepstack mergers"
        )
    if values["out_hidden_size"] != text_hidden:
        raise CheckpointError(f"{where}: the vision tower outputs width {values['out_hidden_size']} but the language model is {text_hidden} wide")
    try:
        return Qwen3VisionConfig(**values)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'config'}: {e['msg']}" for e in exc.errors())
        raise CheckpointError(f"vision tower config ({stated_in}) is not a valid Qwen3-VL vision tower: {problems}") from None


def _h3_defaults(values: dict[str, Any], mergers: int, where: Path) -> dict[str, Any]:
    shapes = {"hidden_size": values["hidden_size"], "depth": values["depth"], "deepstack_mergers": mergers}
    if shapes != H3_VISION_SHAPES:
        raise CheckpointError(
            f"{where} does not state its vision tower's heads and deepstack layers, and its tower is not H3's "
            f"({values['depth']} blocks of width {values['hidden_size']}, {mergers} deepstack mergers): put the model's "
            "config.json (with its vision_config) in a folder with the file and pass the folder"
        )
    return {**H3_VISION_STATED, **values}


def expected_vision_shapes(config: Qwen3VisionConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of the tower (names under its prefix) and its shape."""
    d, i, m2 = config.hidden_size, config.intermediate_size, config.hidden_size * config.spatial_merge_size**2
    p = config.patch_size
    shapes: dict[str, tuple[int, ...]] = {
        "patch_embed.proj.weight": (d, config.in_channels, config.temporal_patch_size, p, p), "patch_embed.proj.bias": (d,),
        "pos_embed.weight": (config.num_position_embeddings, d),
    }
    block = {"norm1": (d,), "norm2": (d,), "attn.qkv": (3 * d, d), "attn.proj": (d, d), "mlp.linear_fc1": (i, d), "mlp.linear_fc2": (d, i)}
    for index in range(config.depth):
        shapes |= _module_shapes(f"blocks.{index}.", block)
    merger = {"linear_fc1": (m2, m2), "linear_fc2": (config.out_hidden_size, m2)}
    shapes |= _module_shapes("merger.", {"norm": (d,), **merger})
    for index in range(len(config.deepstack_visual_indexes)):
        shapes |= _module_shapes(f"deepstack_merger_list.{index}.", {"norm": (m2,), **merger})
    return shapes


def _module_shapes(prefix: str, modules: Mapping[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """`weight` and `bias` of each norm or linear (`(out, in)` for a linear, `(width,)` for a norm)."""
    return {f"{prefix}{name}.{part}": (shape if part == "weight" else shape[:1]) for name, shape in modules.items() for part in ("weight", "bias")}


def check_vision_tensors(reader: SafetensorsReader, markers: Markers, prefix: str, config: Qwen3VisionConfig) -> None:
    """Every tensor of the tower exists, dense float, with the shape the config implies; one line for the first that does not."""
    for name, shape in expected_vision_shapes(config).items():
        module = f"{prefix}{name.rsplit('.', 1)[0]}"
        if markers(module) is not None:
            raise CheckpointError(f"{module} is quantized ({markers(module).format}); h3 reads the vision tower unquantized (bf16)")  # type: ignore[union-attr]
        check_shape(reader, f"{prefix}{name}", shape, FLOAT_DTYPE_NAMES)


@dataclass(frozen=True)
class VisionSpec:
    """A checkpoint's vision tower settled from headers (no weight read), with the image processor that feeds it."""

    prefix: str
    config: Qwen3VisionConfig
    processor: ImageProcessor
    config_source: str


def inspect_vision(
    reader: SafetensorsReader, markers: Markers, kind: str, checkpoint: TextCheckpoint, text_config: Qwen3TextConfig
) -> VisionSpec:
    """Everything keyframes need checked from headers: the tower's presence, config and tensors, the
    M-RoPE sections, and a processor whose patch, frames and merge are the tower's."""
    prefix = vision_prefix(reader, kind)
    if prefix is None:
        raise KeyframeError(
            f"keyframes need a text encoder with Qwen3-VL's vision tower, and {checkpoint.path} has none (no "
            f"{VISION_PREFIXES.get(kind, 'visual.')}* tensors); use ComfyUI's qwen3vl_32b_minimax_h3 file or the official "
            "FL2VA folder, or drop the keyframes"
        )
    raw, source = stated_config(reader, checkpoint)
    config = resolve_vision_config(reader, prefix, raw, source, text_hidden=text_config.hidden_size, where=checkpoint.path)
    check_vision_tensors(reader, markers, prefix, config)
    if mrope_sections(text_config) is None:
        raise CheckpointError(
            f"{checkpoint.path} does not state its language model's mrope_section, and its {text_config.head_dim}-wide heads "
            "are not Qwen3-VL's 128 (sections 24, 20, 20): put the model's config.json beside it"
        )
    processor = ImageProcessor(read_processor_config(checkpoint.processor_folders))
    ours = (processor.config.patch_size, processor.config.temporal_patch_size, processor.config.merge_size)
    tower = (config.patch_size, config.temporal_patch_size, config.spatial_merge_size)
    if ours != tower:
        raise CheckpointError(
            f"the image processor ({processor.config.source}) makes patches of {ours[0]} px x {ours[1]} frames merged "
            f"{ours[2]}x{ours[2]}, the vision tower of {checkpoint.path} takes {tower[0]} px x {tower[1]} merged "
            f"{tower[2]}x{tower[2]}: use the processor config that belongs to these weights"
        )
    return VisionSpec(prefix, config, processor, source)
