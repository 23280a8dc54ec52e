"""Small random Qwen3 / Qwen3-VL checkpoints for the text-encoder tests, built offline.

The reference is Hugging Face `transformers` (a test-only dependency): a tiny `Qwen3Model` with
non-trivial random weights, its tensors written under the plain Qwen3 names or renamed into the
Qwen3-VL layout next to a real (tiny) vision tower and an lm_head, a `config.json` as
transformers writes it, and a byte-level BPE `tokenizer.json` trained on a few sentences with
the `tokenizers` package (no hub access).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

VOCAB = 320
HIDDEN = 64
LAYERS = 3
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 16
INTERMEDIATE = 96
VL_THETA = 5_000_000.0

PROMPT = "a red fox running through snow, wind noise and distant bells"

_CORPUS = [
    "a red fox running through snow, wind noise",
    "waves crash on a rocky shore at sunset while gulls call",
    "a city street at night, rain, neon lights and passing cars",
    "close-up of a violin being played in a quiet room",
] * 4


TEXT_FIELDS = dict(
    vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=LAYERS,
    num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, rms_norm_eps=1e-6,
)


def qwen3_config(theta: float = VL_THETA, **overrides):
    from transformers import Qwen3Config

    return Qwen3Config(**(TEXT_FIELDS | overrides), rope_parameters={"rope_type": "default", "rope_theta": theta})


def qwen3_reference(state: dict[str, torch.Tensor], theta: float = VL_THETA, **overrides):
    """A transformers `Qwen3Model` (fp32, eval) holding `state` (its own key names)."""
    from transformers import Qwen3Model

    model = Qwen3Model(qwen3_config(theta, **overrides))
    model.load_state_dict(state)
    return model.eval()


def random_qwen3_state(seed: int = 0, **overrides) -> dict[str, torch.Tensor]:
    """A Qwen3Model state dict with weights big enough to make every op matter."""
    from transformers import Qwen3Model

    torch.manual_seed(seed)
    model = Qwen3Model(qwen3_config(**overrides))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            elif name == "embed_tokens.weight" or name.endswith(".bias"):
                param.normal_(0.0, 1.0)
            else:
                param.normal_(0.0, 1.0 / param.shape[1] ** 0.5)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def reference_states(model, token_ids: list[int]) -> tuple[torch.Tensor, ...]:
    """transformers' `hidden_states` for one prompt: (embedding, layer 1, ..., final-norm output)."""
    with torch.no_grad():
        out = model(torch.tensor([token_ids]), output_hidden_states=True)
    return tuple(h[0] for h in out.hidden_states)


def qwen3_config_json(theta: float = VL_THETA, **overrides) -> dict:
    return qwen3_config(theta, **overrides).to_dict()


def qwen3_vl_model(text_state: dict[str, torch.Tensor], theta: float = VL_THETA):
    """A tiny `Qwen3VLForConditionalGeneration` whose language model holds `text_state`."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    rope = {"rope_type": "default", "rope_theta": theta, "mrope_section": [4, 2, 2], "mrope_interleaved": True}
    config = Qwen3VLConfig(
        text_config={**TEXT_FIELDS, "rope_parameters": rope},
        vision_config=dict(
            depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=HIDDEN,
            deepstack_visual_indexes=[0], num_position_embeddings=16, patch_size=4,
        ),
    )
    model = Qwen3VLForConditionalGeneration(config).eval()
    model.model.language_model.load_state_dict(text_state)
    return model


def plain_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Qwen3Model keys -> a Qwen3ForCausalLM file's (`model.` prefix)."""
    return {f"model.{k}": v for k, v in state.items()}


def vl_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Qwen3Model keys -> Qwen3-VL's (`model.language_model.` prefix)."""
    return {f"model.language_model.{k}": v for k, v in state.items()}


def train_tokenizer(path: Path) -> Path:
    """A byte-level BPE tokenizer.json (Qwen's kind) with fewer than VOCAB entries."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB - 20, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tokenizer.train_from_iterator(_CORPUS, trainer)
    tokenizer.save(str(path))
    return path


def write_checkpoint(
    folder: Path,
    tensors: dict[str, torch.Tensor],
    *,
    config: dict | None,
    tokenizer: Path | None,
    shards: int = 1,
) -> Path:
    """Write `tensors` as `shards` safetensors files (+ config.json, tokenizer.json) into `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    names = list(tensors)
    per_shard = -(-len(names) // shards)
    for index in range(shards):
        part = {n: tensors[n].contiguous() for n in names[index * per_shard : (index + 1) * per_shard]}
        save_file(part, str(folder / f"model-{index + 1:05d}-of-{shards:05d}.safetensors"))
    if config is not None:
        (folder / "config.json").write_text(json.dumps(config))
    if tokenizer is not None:
        (folder / "tokenizer.json").write_bytes(tokenizer.read_bytes())
    return folder


def tensor_bytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def max_relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """`max |actual - expected| / max |expected|` over the whole tensor."""
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    return float((actual - expected).abs().max() / expected.abs().max())
