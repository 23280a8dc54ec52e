"""Small random Qwen3-VL / Qwen3 text encoders for the text-encoder tests, in every layout h3 reads,
built offline.

The reference is Hugging Face `transformers` (test extra): a tiny `Qwen3VLForConditionalGeneration`
(a real vision tower, text path widths 64 / 4 heads / 2 kv heads of 16) with non-trivial random
weights. Writers put it on disk as

- the official / HF folder (`FL2VA/text_encoder/` index + shards + config.json, `FL2VA/tokenizer/`);
- ComfyUI's single file (`model.layers.L.*`, `visual.*`, truncated after a layer, no final norm),
  in float32, or NVFP4-AWQ + int8 embedding quantized by comfy-kitchen itself (its eager CPU
  backend), whose dequantized weights are what transformers then runs;
- plain Qwen3 (`model.*` + `lm_head`, transformers' `Qwen3Model` as reference).

Tensors h3 must never read (vision tower, lm_head, layers past the output layer) are NaN-filled.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

HIDDEN = 64
LAYERS = 3
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 16
INTERMEDIATE = 96
THETA = 5_000_000.0
H3_VOCAB = 151_936
"""Qwen3-VL's embedding rows: every id of H3's tokenizer has one."""
SMALL_VOCAB = 320
"""For folder tests with their own small trained tokenizer."""

PROMPTS = [
    "a red fox running through snow, wind noise and distant bells",
    "<d>[English] Then I will take two.</d> A man at a market stall, crowd murmur",
    "一只红狐狸在雪地里奔跑，风声呼啸 <|cutoff|> café naïve 🦊",
]

_CORPUS = [
    "a red fox running through snow, wind noise",
    "waves crash on a rocky shore at sunset while gulls call",
    "a city street at night, rain, neon lights and passing cars",
    "close-up of a violin being played in a quiet room",
] * 4

AWQ_LINEARS = ("self_attn.o_proj", "mlp.down_proj")
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def text_fields(vocab: int) -> dict:
    return dict(
        vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, rms_norm_eps=1e-6,
    )


def qwen3_vl_model(seed: int = 0, vocab: int = H3_VOCAB):
    """A tiny random `Qwen3VLForConditionalGeneration` (fp32, eval) with weights big enough to make every op matter."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    rope = {"rope_type": "default", "rope_theta": THETA, "mrope_section": [4, 2, 2], "mrope_interleaved": True}
    config = Qwen3VLConfig(
        text_config={**text_fields(vocab), "rope_parameters": rope},
        vision_config=dict(
            depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=HIDDEN,
            deepstack_visual_indexes=[0], num_position_embeddings=16, patch_size=4,
        ),
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = Qwen3VLForConditionalGeneration(config).eval()
    _randomize(model.model.language_model)
    return model


KEYFRAME_VISION = dict(
    depth=3, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=HIDDEN, deepstack_visual_indexes=[0, 2],
    num_position_embeddings=64, patch_size=16, temporal_patch_size=2, spatial_merge_size=2,
)
"""A tiny vision tower with H3's patch geometry (16 px, 2 frames, 2x2 merge: the official processor
values fit it), an 8 x 8 position grid and two deepstack mergers (after blocks 0 and 2)."""


def qwen3_vl_keyframe_model(seed: int = 0):
    """`qwen3_vl_model`'s text path with `KEYFRAME_VISION`, every weight random and non-trivial."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    rope = {"rope_type": "default", "rope_theta": THETA, "mrope_section": [4, 2, 2], "mrope_interleaved": True}
    config = Qwen3VLConfig(text_config={**text_fields(H3_VOCAB), "rope_parameters": rope}, vision_config=KEYFRAME_VISION, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = Qwen3VLForConditionalGeneration(config).eval()
    _randomize(model.model.language_model)
    randomize_vision(model.model.visual)
    return model


def randomize_vision(module: torch.nn.Module) -> None:
    """Norm gains near 1, biases and the position table of order 1, weights variance-preserving."""
    with torch.no_grad():
        for name, param in module.named_parameters():
            if "norm" in name and name.endswith(".weight"):
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            elif name.endswith(".bias") or name == "pos_embed.weight":
                param.normal_(0.0, 0.5)
            else:
                param.normal_(0.0, 1.0 / param[0].numel() ** 0.5)


def _randomize(module: torch.nn.Module) -> None:
    with torch.no_grad():
        for name, param in module.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            elif name.endswith("embed_tokens.weight") or name.endswith(".bias"):
                param.normal_(0.0, 1.0)
            else:
                param.normal_(0.0, 1.0 / param.shape[1] ** 0.5)


def hidden_states(vl, token_ids: list[int]) -> tuple[torch.Tensor, ...]:
    """What H3's reference reads (diffusers `encoders.py`): `text_encoder.model(...)`'s
    `hidden_states` (embedding, layer 1, ..., final-normed last layer), each [L, D]."""
    ids = torch.tensor([token_ids])
    with torch.no_grad():
        out = vl.model(input_ids=ids, attention_mask=torch.ones_like(ids), output_hidden_states=True)
    return tuple(h[0] for h in out.hidden_states)


def last_layer_unnormed(vl, token_ids: list[int]) -> torch.Tensor:
    """The last decoder layer's own output (before the final norm), which `hidden_states` does not expose."""
    captured = []
    handle = vl.model.language_model.layers[-1].register_forward_hook(lambda m, a, out: captured.append(out))
    try:
        hidden_states(vl, token_ids)
    finally:
        handle.remove()
    out = captured[0][0] if isinstance(captured[0], tuple) else captured[0]
    return out[0]


def text_state(vl) -> dict[str, torch.Tensor]:
    """The language model's state dict (its own key names: `embed_tokens.weight`, `layers.N.*`, `norm.weight`)."""
    return {k: v.detach().clone() for k, v in vl.model.language_model.state_dict().items()}


def load_text_state(vl, state: dict[str, torch.Tensor]) -> None:
    vl.model.language_model.load_state_dict(state)


# --- layouts on disk ---------------------------------------------------------------------------------


def official_folder(root: Path, vl, tokenizer_source: Path, shards: int = 3, *, vision: bool = False) -> Path:
    """The official layout: `root/text_encoder/` (config.json, index, shards with `model.language_model.*`,
    the vision tower -- NaN unless `vision` -- and a NaN lm_head) and `root/tokenizer/` (transformers'
    save of `tokenizer_source`)."""
    from transformers import AutoTokenizer

    kept = ("model.language_model.", "model.visual.") if vision else ("model.language_model.",)
    tensors = {k: v.detach().clone() for k, v in vl.state_dict().items()}
    tensors = {k: (v if k.startswith(kept) else torch.full_like(v, float("nan"))) for k, v in tensors.items()}
    folder = root / "text_encoder"
    write_shards(folder, tensors, shards=shards, index=True)
    (folder / "config.json").write_text(json.dumps(vl.config.to_dict()))
    AutoTokenizer.from_pretrained(str(tokenizer_source)).save_pretrained(str(root / "tokenizer"))
    return root


def comfy_names(vl, layers: int, *, vision: bool = False) -> dict[str, torch.Tensor]:
    """ComfyUI's single-file names of `vl` cut after `layers` layers: `model.X` for the language model's
    `X` (no final norm, no lm_head), `visual.X` for the vision tower (NaN unless `vision`)."""
    tensors: dict[str, torch.Tensor] = {}
    for key, value in vl.state_dict().items():
        if key.startswith("model.language_model."):
            name = key.removeprefix("model.language_model.")
            if name == "norm.weight" or (name.startswith("layers.") and int(name.split(".")[1]) >= layers):
                continue
            tensors[f"model.{name}"] = value.detach().clone()
        elif key.startswith("model.visual."):
            tensors["visual." + key.removeprefix("model.visual.")] = value.detach().clone() if vision else torch.full_like(value, float("nan"))
    return tensors


def comfy_nvfp4_awq(vl, layers: int, seed: int = 1) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """`vl` cut after `layers` layers as H3's Comfy NVFP4-AWQ file, quantized by comfy-kitchen: NVFP4
    linears (markers with full_precision_matrix_mult, AWQ pre-scales on o_proj and down_proj), an
    int8_tensorwise embedding, bf16 norms. Returns (file tensors, the text state transformers must
    run: comfy-kitchen's dequantized weights, pre-scales folded in)."""
    import comfy_kitchen as ck

    from h3core.nvfp4.codec import GLOBAL_SCALE_DIVISOR

    generator = torch.Generator().manual_seed(seed)
    tensors = comfy_names(vl, layers)
    reference = text_state(vl)
    marker = _marker({"format": "nvfp4", "full_precision_matrix_mult": True})
    for layer in range(layers):
        for name in LINEARS:
            key = f"layers.{layer}.{name}"
            weight = tensors.pop(f"model.{key}.weight")  # [out, in]
            pre_scale = torch.exp(0.5 * torch.randn(weight.shape[1], generator=generator)).to(torch.bfloat16) if name in AWQ_LINEARS else None
            scaled = weight / pre_scale.float() if pre_scale is not None else weight
            global_scale = (scaled.abs().amax() / GLOBAL_SCALE_DIVISOR).float()
            packed, block_scale = ck.quantize_nvfp4(scaled, global_scale, pad_16x=True)
            tensors |= {f"model.{key}.weight": packed, f"model.{key}.weight_scale": block_scale,
                        f"model.{key}.weight_scale_2": global_scale, f"model.{key}.comfy_quant": marker.clone()}
            dense = ck.dequantize_nvfp4(packed, global_scale, block_scale, torch.float32)[: weight.shape[0], : weight.shape[1]]
            if pre_scale is not None:
                tensors[f"model.{key}.pre_quant_scale"] = pre_scale
                dense = dense * pre_scale.float()
            reference[f"{key}.weight"] = dense
        for name in ("input_layernorm", "post_attention_layernorm", "self_attn.q_norm", "self_attn.k_norm"):
            key = f"layers.{layer}.{name}.weight"
            tensors[f"model.{key}"] = tensors[f"model.{key}"].to(torch.bfloat16)
            reference[key] = tensors[f"model.{key}"].float()
    q, scale = ck.quantize_int8_rowwise(tensors.pop("model.embed_tokens.weight"))
    tensors |= {"model.embed_tokens.weight": q, "model.embed_tokens.weight_scale": scale,
                "model.embed_tokens.comfy_quant": _marker({"format": "int8_tensorwise"})}
    reference["embed_tokens.weight"] = q.float() * scale
    return tensors, reference


def _marker(fields: dict) -> torch.Tensor:
    return torch.tensor(list(json.dumps(fields).encode()), dtype=torch.uint8)


def write_file(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata=metadata)
    return path


def write_shards(folder: Path, tensors: dict[str, torch.Tensor], *, shards: int = 1, index: bool = False) -> Path:
    """`tensors` as `shards` safetensors files in `folder` (and `model.safetensors.index.json`)."""
    folder.mkdir(parents=True, exist_ok=True)
    names = list(tensors)
    per_shard = -(-len(names) // shards)
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[i * per_shard : (i + 1) * per_shard]}
        write_file(folder / file, part)
        weight_map |= dict.fromkeys(part, file)
    if index:
        (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


# --- plain Qwen3 ----------------------------------------------------------------------------------


def qwen3_config(vocab: int = SMALL_VOCAB, theta: float = THETA, **overrides):
    from transformers import Qwen3Config

    return Qwen3Config(**(text_fields(vocab) | overrides), rope_parameters={"rope_type": "default", "rope_theta": theta})


def qwen3_config_json(vocab: int = SMALL_VOCAB, **overrides) -> dict:
    return qwen3_config(vocab, **overrides).to_dict()


def random_qwen3_state(seed: int = 0, vocab: int = SMALL_VOCAB, **overrides) -> dict[str, torch.Tensor]:
    """A transformers `Qwen3Model` state dict (its own key names) with random weights."""
    from transformers import Qwen3Model

    torch.manual_seed(seed)
    model = Qwen3Model(qwen3_config(vocab, **overrides))
    _randomize(model)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def qwen3_reference(state: dict[str, torch.Tensor], vocab: int = SMALL_VOCAB, **overrides):
    from transformers import Qwen3Model

    model = Qwen3Model(qwen3_config(vocab, **overrides))
    model.load_state_dict(state)
    return model.eval()


def qwen3_hidden_states(model, token_ids: list[int]) -> tuple[torch.Tensor, ...]:
    with torch.no_grad():
        out = model(torch.tensor([token_ids]), output_hidden_states=True)
    return tuple(h[0] for h in out.hidden_states)


def plain_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Qwen3Model keys -> a Qwen3ForCausalLM file's (`model.` prefix)."""
    return {f"model.{k}": v for k, v in state.items()}


def plain_folder(folder: Path, state: dict[str, torch.Tensor], *, config: dict | None, tokenizer: Path | None, shards: int = 1) -> Path:
    """A plain Qwen3 folder: shards of `model.*` (+ a NaN lm_head), config.json, tokenizer.json."""
    lm_head = torch.full((state["embed_tokens.weight"].shape[0], HIDDEN), float("nan"))
    write_shards(folder, plain_names(state) | {"lm_head.weight": lm_head}, shards=shards)
    if config is not None:
        (folder / "config.json").write_text(json.dumps(config))
    if tokenizer is not None:
        (folder / "tokenizer.json").write_bytes(tokenizer.read_bytes())
    return folder


def train_tokenizer(path: Path) -> Path:
    """A byte-level BPE tokenizer.json (Qwen's kind) with fewer than SMALL_VOCAB entries."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=SMALL_VOCAB - 20, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tokenizer.train_from_iterator(_CORPUS, trainer)
    tokenizer.save(str(path))
    return path


def tensor_bytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def max_relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """`max |actual - expected| / max |expected|` over the whole tensor."""
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    return float((actual - expected).abs().max() / expected.abs().max())
