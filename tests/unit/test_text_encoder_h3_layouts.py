"""H3's own text-encoder files at full size, headers only: sparse files with the real tensor names,
dtypes and shapes (../shared/MINIMAX_H3.md 4.3; the Comfy schema below reproduces that file's
15,686,911,143-byte payload exactly) and real marker bytes, everything else holes. h3 must accept
them as they are -- layout, config, output layer 50, markers, tokenizer -- before reading a weight."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest

from h3core.text import check_text_encoder
from h3core.text.encoder import _inspect, vision_tower_bytes
from h3core.text.tokenizer import SHIPPED_FOLDER, SHIPPED_NAME

D, Q, KV, F, V, LAYERS_KEPT = 5120, 8192, 1024, 25600, 151_936, 50
VISION, VISION_MLP, MERGED = 1152, 4304, 4608
NVFP4_MARKER = b'{"format": "nvfp4", "full_precision_matrix_mult": true}'
INT8_MARKER = b'{"format": "int8_tensorwise"}'
COMFY_FILE_BYTES = 15_687_142_551
COMFY_PAYLOAD_BYTES = 15_686_911_143
_ITEM = {"BF16": 2, "F32": 4, "U8": 1, "I8": 1, "F8_E4M3": 1}
LINEARS = {"self_attn.q_proj": (Q, D), "self_attn.k_proj": (KV, D), "self_attn.v_proj": (KV, D), "self_attn.o_proj": (D, Q),
           "mlp.gate_proj": (F, D), "mlp.up_proj": (F, D), "mlp.down_proj": (D, F)}


def _vision(prefix: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Qwen3-VL-32B's vision tower (27 blocks, 3 deepstack mergers), bf16."""
    specs = {f"{prefix}patch_embed.proj.weight": (VISION, 3, 2, 16, 16), f"{prefix}patch_embed.proj.bias": (VISION,),
             f"{prefix}pos_embed.weight": (2304, VISION)}
    for b in range(27):
        block = f"{prefix}blocks.{b}."
        for name, shape in {"attn.qkv": (3 * VISION, VISION), "attn.proj": (VISION, VISION), "mlp.linear_fc1": (VISION_MLP, VISION),
                            "mlp.linear_fc2": (VISION, VISION_MLP), "norm1": (VISION,), "norm2": (VISION,)}.items():
            specs[f"{block}{name}.weight"], specs[f"{block}{name}.bias"] = shape, (shape[0],)
    for merger, norm in [("merger.", VISION)] + [(f"deepstack_merger_list.{i}.", MERGED) for i in range(3)]:
        for name, shape in {"norm": (norm,), "linear_fc1": (MERGED, MERGED), "linear_fc2": (D, MERGED)}.items():
            specs[f"{prefix}{merger}{name}.weight"], specs[f"{prefix}{merger}{name}.bias"] = shape, (shape[0],)
    return {name: ("BF16", shape) for name, shape in specs.items()}


def comfy_schema() -> tuple[dict[str, tuple[str, tuple[int, ...]]], dict[str, bytes]]:
    """`qwen3vl_32b_minimax_h3_nvfp4_awq.safetensors`: (name -> (dtype, shape)), (name -> marker bytes)."""
    specs: dict[str, tuple[str, tuple[int, ...]]] = {}
    data: dict[str, bytes] = {}
    for layer in range(LAYERS_KEPT):
        at = f"model.layers.{layer}."
        for name, size in (("input_layernorm", D), ("post_attention_layernorm", D), ("self_attn.q_norm", 128), ("self_attn.k_norm", 128)):
            specs[f"{at}{name}.weight"] = ("BF16", (size,))
        for name, (out, inp) in LINEARS.items():
            specs |= {f"{at}{name}.weight": ("U8", (out, inp // 2)), f"{at}{name}.weight_scale": ("F8_E4M3", (out, inp // 16)),
                      f"{at}{name}.weight_scale_2": ("F32", ()), f"{at}{name}.comfy_quant": ("U8", (len(NVFP4_MARKER),))}
            data[f"{at}{name}.comfy_quant"] = NVFP4_MARKER
            if name in ("self_attn.o_proj", "mlp.down_proj"):
                specs[f"{at}{name}.pre_quant_scale"] = ("BF16", (inp,))
    specs |= {"model.embed_tokens.weight": ("I8", (V, D)), "model.embed_tokens.weight_scale": ("F32", (V, 1)),
              "model.embed_tokens.comfy_quant": ("U8", (len(INT8_MARKER),))}
    data["model.embed_tokens.comfy_quant"] = INT8_MARKER
    return specs | _vision("visual."), data


def official_schema() -> dict[str, tuple[str, tuple[int, ...]]]:
    """`FL2VA/text_encoder/`: the whole bf16 Qwen3-VL-32B under Hugging Face's names."""
    specs = {"model.language_model.embed_tokens.weight": ("BF16", (V, D)), "model.language_model.norm.weight": ("BF16", (D,)),
             "lm_head.weight": ("BF16", (V, D))}
    for layer in range(64):
        at = f"model.language_model.layers.{layer}."
        for name, size in (("input_layernorm", D), ("post_attention_layernorm", D), ("self_attn.q_norm", 128), ("self_attn.k_norm", 128)):
            specs[f"{at}{name}.weight"] = ("BF16", (size,))
        specs |= {f"{at}{name}.weight": ("BF16", shape) for name, shape in LINEARS.items()}
    return specs | _vision("model.visual.")


def write_sparse(path: Path, specs: dict[str, tuple[str, tuple[int, ...]]], data: dict[str, bytes] | None = None) -> int:
    """A safetensors file of `specs` whose tensors are holes except `data`; returns its payload bytes."""
    header, offset = {}, 0
    for name, (dtype, shape) in specs.items():
        size = _ITEM[dtype]
        for n in shape:
            size *= n
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        start = f.tell()
        for name, payload in (data or {}).items():
            f.seek(start + header[name]["data_offsets"][0])
            f.write(payload)
        f.truncate(start + offset)
    return offset


def test_the_comfy_nvfp4_awq_file_is_accepted_from_its_headers(tmp_path):
    specs, markers = comfy_schema()
    assert len(specs) == 2054
    path = tmp_path / "qwen3vl_32b_minimax_h3_nvfp4_awq.safetensors"
    assert write_sparse(path, specs, markers) == COMFY_PAYLOAD_BYTES
    assert check_text_encoder(path, hidden_size=D).name == SHIPPED_NAME
    found = _inspect(path, D, None)
    try:
        config = found.config
        assert (found.kind, found.layers, config.num_layers, config.vocab_size, config.num_heads, config.num_kv_heads) == ("comfy", 50, 50, V, 64, 8)
        assert (config.head_dim, config.intermediate_size, config.rope_theta, config.rms_norm_eps) == (128, F, 5e6, 1e-6)
        assert found.markers("model.layers.49.mlp.down_proj").full_precision_matrix_mult
    finally:
        found.reader.close()
    check_text_encoder(path, hidden_size=D, images=True)  # keyframes: the tower from its headers, H3's config (none stated)
    _check_h3_vision(path)
    assert vision_tower_bytes(path, hidden_size=D) == sum(_bytes(s) for n, s in specs.items() if n.startswith("visual.")) == 1_190_533_600
    layers = sum(_bytes(spec) for name, spec in specs.items() if name.startswith("model.layers."))
    print(f"Comfy NVFP4-AWQ file: h3 reads {layers + len(INT8_MARKER):,} bytes of layers 0..49 and markers, plus "
          f"{D + 4} per distinct prompt token, of {COMFY_FILE_BYTES:,} (the rest: {_bytes(specs['model.embed_tokens.weight']):,} "
          f"of embedding table and {sum(_bytes(s) for n, s in specs.items() if n.startswith('visual.')):,} of vision tower)")


def test_the_official_folder_is_accepted_from_its_headers_with_output_layer_50(tmp_path):
    root = tmp_path / "FL2VA"
    (root / "text_encoder").mkdir(parents=True)
    specs = official_schema()
    names, shards = list(specs), 16  # ~4 GB each, as the official shards
    weight_map = {}
    for shard in range(shards):
        part = names[shard::shards]
        file = f"model-{shard + 1:05d}-of-{shards:05d}.safetensors"
        write_sparse(root / "text_encoder" / file, {n: specs[n] for n in part})
        weight_map |= dict.fromkeys(part, file)
    (root / "text_encoder" / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    official_config = {"model_type": "qwen3_vl", "text_config": {
        "model_type": "qwen3_vl_text", "hidden_size": D, "intermediate_size": F, "num_hidden_layers": 64, "num_attention_heads": 64,
        "num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-6, "rope_theta": 5000000, "vocab_size": V, "hidden_act": "silu",
        "rope_scaling": {"mrope_interleaved": True, "mrope_section": [24, 20, 20], "rope_type": "default"}, "attention_bias": False}}
    (root / "text_encoder" / "config.json").write_text(json.dumps(official_config))
    with pytest.raises(Exception, match="has no tokenizer"):
        check_text_encoder(root, hidden_size=D)
    shutil.copytree(SHIPPED_FOLDER, root / "tokenizer")
    assert check_text_encoder(root, hidden_size=D).name == str(root / "tokenizer")
    found = _inspect(root, D, None)
    found.reader.close()
    assert (found.kind, found.layers, found.config.num_layers) == ("qwen3-vl", 50, 64)
    official_config["vision_config"] = {
        "deepstack_visual_indexes": [8, 16, 24], "depth": 27, "hidden_act": "gelu_pytorch_tanh", "hidden_size": 1152, "in_channels": 3,
        "initializer_range": 0.02, "intermediate_size": 4304, "model_type": "qwen3_vl", "num_heads": 16, "num_position_embeddings": 2304,
        "out_hidden_size": 5120, "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2,
    }
    (root / "text_encoder" / "config.json").write_text(json.dumps(official_config))
    (root / "processor").mkdir()
    (root / "processor" / "preprocessor_config.json").write_text(json.dumps({
        "size": {"longest_edge": 16777216, "shortest_edge": 65536}, "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2,
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "processor_class": "Qwen3VLProcessor",
        "image_processor_type": "Qwen2VLImageProcessorFast",
    }))
    check_text_encoder(root, hidden_size=D, images=True)
    spec = _check_h3_vision(root)
    assert spec.prefix == "model.visual." and spec.config_source == str(root / "text_encoder" / "config.json")
    assert spec.processor.config.source == str(root / "processor" / "preprocessor_config.json")


def _check_h3_vision(path: Path):
    """The vision tower h3 would build for keyframes from `path`'s headers: Qwen3-VL-32B's."""
    from h3core.text.vision_checkpoint import inspect_vision

    found = _inspect(path, D, None)
    try:
        spec = inspect_vision(found.reader, found.markers, found.kind, found.checkpoint, found.config)
    finally:
        found.reader.close()
    config = spec.config
    assert (config.depth, config.hidden_size, config.num_heads, config.intermediate_size, config.out_hidden_size) == (27, VISION, 16, VISION_MLP, D)
    assert (config.patch_size, config.temporal_patch_size, config.spatial_merge_size, config.grid_side) == (16, 2, 2, 48)
    assert config.deepstack_visual_indexes == (8, 16, 24) and config.hidden_act == "gelu_pytorch_tanh"
    assert spec.processor.image_tokens((864, 480)) == 405  # MINIMAX_H3.md 2.6
    return spec


def _bytes(spec: tuple[str, tuple[int, ...]]) -> int:
    size = _ITEM[spec[0]]
    for n in spec[1]:
        size *= n
    return size
