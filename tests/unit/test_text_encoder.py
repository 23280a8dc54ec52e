"""The text encoder against Hugging Face transformers on small random Qwen3 / Qwen3-VL checkpoints:
plain and Qwen3-VL key layouts, NVFP4 (+AWQ pre-scale) and bf16 linears, output layers,
truncation, and that the vision tower and lm_head are never read."""

from __future__ import annotations

import weakref

import pytest
import torch
from qwen3_checkpoints import (
    HIDDEN,
    LAYERS,
    PROMPT,
    max_relative_error,
    plain_names,
    qwen3_config_json,
    qwen3_reference,
    qwen3_vl_model,
    random_qwen3_state,
    reference_states,
    tensor_bytes,
    train_tokenizer,
    vl_names,
    write_checkpoint,
)

from h3core.nvfp4.codec import dequantize, quantize
from h3core.nvfp4.io import linear_tensors
from h3core.nvfp4.linear import NVFP4Linear
from h3core.text import load_text_encoder, release_text_encoder

TOLERANCE = 1e-5  # max |h3 - transformers| / max |transformers|, float32
MAX_TOKENS = 512

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


@pytest.fixture(scope="module")
def state() -> dict[str, torch.Tensor]:
    return random_qwen3_state(seed=0)


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory):
    return train_tokenizer(tmp_path_factory.mktemp("tokenizer") / "tokenizer.json")


@pytest.fixture(scope="module")
def token_ids(tokenizer_file) -> list[int]:
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(tokenizer_file)).encode(PROMPT).ids
    assert 10 < len(ids) < len(PROMPT)  # merges happened, and there is something to attend over
    return ids


@pytest.fixture(scope="module")
def reference(state, token_ids) -> tuple[torch.Tensor, ...]:
    return reference_states(qwen3_reference(state), token_ids)


def test_plain_qwen3_matches_transformers(tmp_path, state, tokenizer_file, reference):
    tensors = plain_names(state) | {"lm_head.weight": torch.randn(320, HIDDEN)}
    folder = write_checkpoint(tmp_path, tensors, config=qwen3_config_json(), tokenizer=tokenizer_file, shards=2)
    encoder = load_text_encoder(folder, hidden_size=HIDDEN)
    states = encoder.encode(PROMPT, MAX_TOKENS)
    assert states.dtype == torch.float32 and states.device.type == "cpu"
    assert max_relative_error(states, reference[-1]) <= TOLERANCE
    info = encoder.info
    assert (info.kind, info.linears, info.layers, info.output_layer, info.hidden_size) == ("qwen3", "dense", LAYERS, LAYERS, HIDDEN)
    assert info.config_source == str(folder / "config.json")
    assert info.tokenizer == str(folder / "tokenizer.json")
    assert info.bytes_read == tensor_bytes(plain_names(state))  # lm_head never read


def test_qwen3_vl_layout_reads_only_the_text_path(tmp_path, state, tokenizer_file, token_ids, reference):
    vl = qwen3_vl_model(state)
    everything = vl.state_dict()
    text = {k: v for k, v in everything.items() if k.startswith("model.language_model.")}
    untouched = {k: torch.full_like(v, float("nan")) for k, v in everything.items() if k not in text}
    assert any(k.startswith("model.visual.") for k in untouched) and "lm_head.weight" in untouched
    folder = write_checkpoint(
        tmp_path, untouched | text, config=vl.config.to_dict(), tokenizer=tokenizer_file, shards=3
    )
    encoder = load_text_encoder(folder, hidden_size=HIDDEN)
    states = encoder.encode(PROMPT, MAX_TOKENS)
    # The same weights under Qwen3 names, and transformers' own Qwen3-VL text model (multimodal
    # RoPE with text-only positions): both agree with h3.
    assert max_relative_error(states, reference[-1]) <= TOLERANCE
    with torch.no_grad():
        vl_states = vl.model.language_model(input_ids=torch.tensor([token_ids])).last_hidden_state[0]
    assert max_relative_error(states, vl_states) <= TOLERANCE
    assert encoder.info.kind == "qwen3-vl"
    assert encoder.info.bytes_read == tensor_bytes(text)  # NaN-filled vision tower and lm_head: never read
    assert encoder.info.bytes_on_disk > tensor_bytes(everything)


def test_config_inferred_from_shapes_without_config_json(tmp_path, state, tokenizer_file, reference):
    # Qwen3-VL layout with no config.json: the RoPE base defaults to Qwen3-VL's 5e6 (as the fixture's).
    folder = write_checkpoint(tmp_path, vl_names(state), config=None, tokenizer=tokenizer_file)
    encoder = load_text_encoder(folder / "model-00001-of-00001.safetensors", hidden_size=HIDDEN)
    assert encoder.info.config_source == "inferred from tensor shapes"
    assert max_relative_error(encoder.encode(PROMPT, MAX_TOKENS), reference[-1]) <= TOLERANCE


def _nvfp4_awq(state: dict[str, torch.Tensor], prefix: str, seed: int):
    """Quantize every linear (AWQ pre-scale on alternate layers); return (file tensors, the dense
    state transformers must see: dequantized weights with the pre-scale folded in)."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {f"{prefix}{k}": v for k, v in state.items()}
    folded = dict(state)
    for layer in range(LAYERS):
        for name in LINEARS:
            key = f"layers.{layer}.{name}"
            weight = state[f"{key}.weight"]  # [out, in]
            awq = layer % 2 == 0
            pre_scale = torch.exp(0.5 * torch.randn(weight.shape[1], generator=generator)).to(torch.bfloat16) if awq else None
            scaled = weight / pre_scale.float() if awq else weight
            linear = NVFP4Linear(quantize(scaled), pre_quant_scale=pre_scale, input_scale=torch.tensor(0.01))
            del tensors[f"{prefix}{key}.weight"]
            tensors |= linear_tensors(f"{prefix}{key}", linear)
            dense = dequantize(linear.nvfp4)  # [out, in] float32
            folded[f"{key}.weight"] = dense * pre_scale.float() if awq else dense
    return tensors, folded


@pytest.mark.parametrize("prefix", ["model.", "model.language_model."])
def test_nvfp4_awq_matches_transformers_on_dequantized_weights(tmp_path, state, tokenizer_file, token_ids, prefix):
    tensors, folded = _nvfp4_awq(state, prefix, seed=1)
    folder = write_checkpoint(tmp_path, tensors, config=qwen3_config_json(), tokenizer=tokenizer_file)
    encoder = load_text_encoder(folder, hidden_size=HIDDEN)
    expected = reference_states(qwen3_reference(folded), token_ids)[-1]
    assert max_relative_error(encoder.encode(PROMPT, MAX_TOKENS), expected) <= TOLERANCE
    assert encoder.info.linears == "nvfp4"
    assert encoder.info.bytes_read == tensor_bytes(tensors)
    assert encoder.info.resident_bytes < tensor_bytes(state)  # packed, not dense, in memory


def test_bf16_dense_linears(tmp_path, state, tokenizer_file, token_ids):
    bf16 = {k: v.to(torch.bfloat16) for k, v in state.items()}
    folder = write_checkpoint(tmp_path, plain_names(bf16), config=qwen3_config_json(), tokenizer=tokenizer_file)
    encoder = load_text_encoder(folder, hidden_size=HIDDEN)
    expected = reference_states(qwen3_reference({k: v.float() for k, v in bf16.items()}), token_ids)[-1]
    assert max_relative_error(encoder.encode(PROMPT, MAX_TOKENS), expected) <= TOLERANCE
    assert encoder.info.resident_bytes == tensor_bytes(bf16)  # kept bf16 in memory


@pytest.mark.parametrize("output_layer, index", [(0, 0), (1, 1), (-2, 2), (-1, 3), (3, 3)])
def test_output_layer_matches_hidden_states_index(tmp_path, state, tokenizer_file, reference, output_layer, index):
    folder = write_checkpoint(tmp_path, plain_names(state), config=qwen3_config_json(), tokenizer=tokenizer_file)
    encoder = load_text_encoder(folder, hidden_size=HIDDEN, output_layer=output_layer)
    assert encoder.info.output_layer == index and encoder.info.layers == index
    assert max_relative_error(encoder.encode(PROMPT, MAX_TOKENS), reference[index]) <= TOLERANCE
    skipped = {k: v for k, v in plain_names(state).items() if _after(k, index)}
    assert encoder.info.bytes_read == tensor_bytes(plain_names(state)) - tensor_bytes(skipped)


def _after(name: str, layers_run: int) -> bool:
    """Whether tensor `name` lies past the first `layers_run` layers (final norm only for the last)."""
    if name == "model.norm.weight":
        return layers_run < LAYERS
    return name.startswith("model.layers.") and int(name.split(".")[2]) >= layers_run


def test_truncation_keeps_the_first_tokens(tmp_path, state, tokenizer_file, token_ids):
    folder = write_checkpoint(tmp_path, plain_names(state), config=qwen3_config_json(), tokenizer=tokenizer_file)
    encoder = load_text_encoder(folder, hidden_size=HIDDEN)
    full = encoder.encode(PROMPT, MAX_TOKENS)
    assert full.shape == (len(token_ids), HIDDEN)
    assert encoder.token_ids(PROMPT, 5) == token_ids[:5]
    # Causal attention: the kept tokens' states do not depend on the dropped ones.
    torch.testing.assert_close(encoder.encode(PROMPT, 5), full[:5], rtol=1e-6, atol=1e-6)
    assert encoder.encode("", MAX_TOKENS).shape == (0, HIDDEN)


def test_release_frees_the_weights(tmp_path, state, tokenizer_file):
    folder = write_checkpoint(tmp_path, plain_names(state), config=qwen3_config_json(), tokenizer=tokenizer_file)
    encoder = load_text_encoder(folder, hidden_size=HIDDEN)
    embedding = weakref.ref(encoder._model.embed_tokens)
    release_text_encoder(encoder)
    assert embedding() is None and encoder.released
    with pytest.raises(RuntimeError, match="released"):
        encoder.encode(PROMPT, MAX_TOKENS)


def test_attention_bias(tmp_path, tokenizer_file, token_ids):
    state = random_qwen3_state(seed=4, attention_bias=True)
    assert "layers.0.self_attn.q_proj.bias" in state
    folder = write_checkpoint(
        tmp_path, plain_names(state), config=qwen3_config_json(attention_bias=True), tokenizer=tokenizer_file
    )
    expected = reference_states(qwen3_reference(state, attention_bias=True), token_ids)[-1]
    assert max_relative_error(load_text_encoder(folder, hidden_size=HIDDEN).encode(PROMPT, MAX_TOKENS), expected) <= TOLERANCE
