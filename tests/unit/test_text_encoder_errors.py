"""Every broken text encoder a user can hand h3 ends in one clear line (a `CheckpointError` /
`ConfigError`), raised by `check_text_encoder` (headers only) as well as by `load_text_encoder`."""

from __future__ import annotations

import json

import pytest
import torch
from qwen3_checkpoints import (
    HIDDEN,
    LAYERS,
    comfy_names,
    plain_folder,
    plain_names,
    qwen3_config_json,
    qwen3_vl_model,
    random_qwen3_state,
    train_tokenizer,
    write_file,
    write_shards,
)

from h3core.errors import CheckpointError, ConfigError
from h3core.nvfp4 import comfy
from h3core.text import check_text_encoder, load_text_encoder


@pytest.fixture(scope="module")
def state() -> dict[str, torch.Tensor]:
    return random_qwen3_state(seed=2)


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory):
    return train_tokenizer(tmp_path_factory.mktemp("tokenizer") / "tokenizer.json")


@pytest.fixture(scope="module")
def comfy_tensors() -> dict[str, torch.Tensor]:
    """ComfyUI's single-file layout of a tiny Qwen3-VL cut after 2 layers (H3's vocabulary)."""
    return comfy_names(qwen3_vl_model(seed=5), 2)


def _fails(path, match: str, error: type[Exception] = CheckpointError, **kwargs) -> str:
    hidden = kwargs.pop("hidden_size", HIDDEN)
    with pytest.raises(error, match=match) as caught:
        load_text_encoder(path, hidden_size=hidden, **kwargs)
    with pytest.raises(error, match=match):
        check_text_encoder(path, hidden_size=hidden, **kwargs)
    message = str(caught.value)
    assert "\n" not in message and "Traceback" not in message
    return message


def _folder(tmp_path, state, tokenizer_file, config=True, **edits):
    tensors = plain_names(state)
    for name, value in edits.items():
        name = name.replace("__", ".")
        if value is None:
            del tensors[name]
        else:
            tensors[name] = value
    folder = tmp_path / "qwen3"
    write_shards(folder, tensors)
    if config:
        (folder / "config.json").write_text(json.dumps(qwen3_config_json() if config is True else config))
    if tokenizer_file is not None:
        (folder / "tokenizer.json").write_bytes(tokenizer_file.read_bytes())
    return folder


# --- files ------------------------------------------------------------------------------------------


def test_missing_file(tmp_path):
    missing = tmp_path / "qwen3vl.safetensors"
    assert str(missing) in _fails(missing, "text encoder not found")


def test_not_a_safetensors_file(tmp_path):
    path = tmp_path / "model.bin"
    path.write_bytes(b"x")
    _fails(path, "is not a .safetensors file")


def test_folder_without_safetensors(tmp_path):
    _fails(tmp_path, "holds no .safetensors file")


def test_index_naming_a_missing_shard(tmp_path, state, tokenizer_file):
    folder = _folder(tmp_path, state, tokenizer_file)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "model-00002-of-00002.safetensors"}}))
    _fails(folder, "names shard model-00002-of-00002.safetensors, which is not in")


def test_truncated_shard(tmp_path, state, tokenizer_file):
    folder = _folder(tmp_path, state, tokenizer_file)
    shard = folder / "model-00001-of-00001.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])
    assert str(shard) in _fails(folder, "truncated")


def test_folder_without_a_tokenizer_names_where_it_looked(tmp_path, state):
    folder = _folder(tmp_path, state, None)
    message = _fails(folder, "has no tokenizer: looked for tokenizer.json or vocab.json", output_layer=1)
    assert str(folder) in message and str(tmp_path / "tokenizer") in message


def test_not_a_qwen3_checkpoint(tmp_path):
    _fails(write_file(tmp_path / "dit.safetensors", {"blocks.0.weight": torch.ones(4)}), "is not a Qwen3-VL / Qwen3 text encoder")


# --- layers and vocabulary --------------------------------------------------------------------------


def test_whole_decoder_with_fewer_layers_than_h3s_output_layer(tmp_path, state, tokenizer_file):
    message = _fails(_folder(tmp_path, state, tokenizer_file), r"has 3 decoder layers, fewer than the output layer 50 H3 conditions on")
    assert "hidden_states[50]" in message


def test_truncated_file_with_fewer_layers_than_asked(tmp_path, comfy_tensors):
    path = write_file(tmp_path / "comfy.safetensors", comfy_tensors)
    _fails(path, r"has 2 decoder layers, fewer than the output layer 3 asked for; use a checkpoint that keeps at least layers 0..2", output_layer=3)
    assert load_text_encoder(path, hidden_size=HIDDEN, output_layer=-2).info.layers == 1


def test_output_layer_before_the_embedding(tmp_path, comfy_tensors):
    _fails(write_file(tmp_path / "comfy.safetensors", comfy_tensors), "before the embedding", error=ConfigError, output_layer=-4)


def test_vocabulary_smaller_than_the_tokenizers_ids(tmp_path, comfy_tensors):
    tensors = dict(comfy_tensors)
    tensors["model.embed_tokens.weight"] = tensors["model.embed_tokens.weight"][:151_000]
    _fails(write_file(tmp_path / "comfy.safetensors", tensors), r"has ids up to 151675 but the embedding of .* has 151000 rows")


def test_token_ids_outside_the_embedding(tmp_path, state, tokenizer_file):
    encoder = load_text_encoder(_folder(tmp_path, state, tokenizer_file), hidden_size=HIDDEN, output_layer=1)
    with pytest.raises(CheckpointError, match="token id 320 is outside the embedding's 320 rows"):
        encoder.encode_ids([3, 320])


def test_a_limit_refuses_rather_than_truncates(tmp_path, comfy_tensors):
    encoder = load_text_encoder(write_file(tmp_path / "comfy.safetensors", comfy_tensors), hidden_size=HIDDEN)
    assert encoder.encode("a fox", 2).shape == (2, HIDDEN)
    with pytest.raises(ConfigError, match="the prompt is 2 tokens, more than the 1 this model takes; shorten it"):
        encoder.encode("a fox", 1)


# --- quantization markers ---------------------------------------------------------------------------


def _marked(tensors: dict[str, torch.Tensor], module: str, fields: dict) -> dict[str, torch.Tensor]:
    return dict(tensors) | {f"{module}.comfy_quant": torch.tensor(list(json.dumps(fields).encode()), dtype=torch.uint8)}


def test_unknown_quantization_format_is_named(tmp_path, comfy_tensors):
    tensors = _marked(comfy_tensors, "model.layers.1.mlp.up_proj", {"format": "svdquant_w4a4"})
    message = _fails(write_file(tmp_path / "comfy.safetensors", tensors), r"model\.layers\.1\.mlp\.up_proj is quantized as 'svdquant_w4a4', a format h3 does not know")
    assert "h3 reads a text encoder's linears as nvfp4 or unquantized" in message


def test_int8_linears_and_nvfp4_embeddings_are_refused(tmp_path, comfy_tensors):
    tensors = _marked(comfy_tensors, "model.layers.0.self_attn.q_proj", {"format": "int8_tensorwise"})
    _fails(write_file(tmp_path / "a.safetensors", tensors), r"q_proj is quantized as 'int8_tensorwise'; h3 reads a text encoder's linears as nvfp4")
    tensors = _marked(comfy_tensors, "model.embed_tokens", {"format": "nvfp4"})
    _fails(write_file(tmp_path / "b.safetensors", tensors), r"embed_tokens is quantized as 'nvfp4'; h3 reads a token embedding as a float table or int8")


def test_convrot_embedding_is_refused(tmp_path, comfy_tensors):
    q, scale = comfy.quantize_int8_rows(comfy_tensors["model.embed_tokens.weight"])
    tensors = _marked(comfy_tensors | {"model.embed_tokens.weight": q, "model.embed_tokens.weight_scale": scale},
                      "model.embed_tokens", {"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": 256})
    _fails(write_file(tmp_path / "comfy.safetensors", tensors), "int8_tensorwise with ConvRot")


def test_malformed_marker(tmp_path, comfy_tensors):
    tensors = dict(comfy_tensors) | {"model.layers.0.mlp.down_proj.comfy_quant": torch.tensor(list(b"{oops"), dtype=torch.uint8)}
    _fails(write_file(tmp_path / "comfy.safetensors", tensors), r"down_proj\.comfy_quant is not a JSON quantization marker")


def test_comfy_nvfp4_scales_of_the_wrong_shape(tmp_path, comfy_tensors):
    weight = comfy_tensors["model.layers.1.self_attn.o_proj.weight"]
    from h3core.nvfp4.codec import quantize

    packed, scale = comfy.to_comfy(quantize(weight))
    tensors = _marked(dict(comfy_tensors), "model.layers.1.self_attn.o_proj", {"format": "nvfp4"})
    tensors |= {"model.layers.1.self_attn.o_proj.weight": packed, "model.layers.1.self_attn.o_proj.weight_scale": scale[:, :2].contiguous(),
                "model.layers.1.self_attn.o_proj.weight_scale_2": torch.tensor(1.0)}
    _fails(write_file(tmp_path / "comfy.safetensors", tensors), r"o_proj\.weight_scale in .* is F8_E4M3 \[128, 2\], expected F8_E4M3 \[128, 4\]")


# --- shapes and config ------------------------------------------------------------------------------


def test_wrong_shape_in_a_later_layer(tmp_path, state, tokenizer_file):
    folder = _folder(tmp_path, state, tokenizer_file, config=False, **{"model__layers__2__mlp__up_proj__weight": torch.randn(80, HIDDEN)})
    _fails(folder, r"model\.layers\.2\.mlp\.up_proj\.weight in .* has shape \[80, 64\] .* needs \[96, 64\]", output_layer=3)


def test_wrong_norm_shape(tmp_path, state, tokenizer_file):
    folder = _folder(tmp_path, state, tokenizer_file, **{"model__layers__1__self_attn__k_norm__weight": torch.ones(8)})
    _fails(folder, r"k_norm\.weight in .*\.safetensors has shape \[8\]", output_layer=2)


def test_missing_tensor(tmp_path, state, tokenizer_file):
    folder = _folder(tmp_path, state, tokenizer_file, **{"model__layers__1__self_attn__o_proj__weight": None})
    _fails(folder, r"lacks tensor model\.layers\.1\.self_attn\.o_proj\.weight", output_layer=2)


def test_missing_layer(tmp_path, state, tokenizer_file):
    tensors = {k: v for k, v in plain_names(state).items() if not k.startswith("model.layers.1.")}
    folder = tmp_path / "gap"
    write_shards(folder, tensors)
    (folder / "tokenizer.json").write_bytes(tokenizer_file.read_bytes())
    _fails(folder, "lacks decoder layer 1")


def test_config_json_disagrees_with_shapes(tmp_path, state, tokenizer_file):
    folder = _folder(tmp_path, state, tokenizer_file, config=qwen3_config_json() | {"num_hidden_layers": LAYERS + 1})
    message = _fails(folder, r"says num_layers = 4 but the checkpoint's tensors have num_layers = 3")
    assert str(folder / "config.json") in message


def test_qwen3_vl_config_json_disagrees_with_shapes(tmp_path, state, tokenizer_file):
    config = {"model_type": "qwen3_vl", "text_config": qwen3_config_json() | {"intermediate_size": 128}, "vision_config": {"depth": 1}}
    _fails(_folder(tmp_path, state, tokenizer_file, config=config), "says intermediate_size = 128 but the checkpoint's tensors have intermediate_size = 96")


def test_hidden_size_must_match_the_denoiser(tmp_path, comfy_tensors):
    _fails(write_file(tmp_path / "comfy.safetensors", comfy_tensors), "hidden size 64 but the denoiser takes text of width 5120", hidden_size=5120)


def test_scaled_rope_is_refused(tmp_path, state, tokenizer_file):
    config = qwen3_config_json() | {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}}
    _fails(_folder(tmp_path, state, tokenizer_file, config=config), "RoPE type 'yarn' is not implemented")


def test_unreadable_config_json(tmp_path, state, tokenizer_file):
    folder = _folder(tmp_path, state, tokenizer_file, config=False)
    (folder / "config.json").write_text("{not json")
    _fails(folder, "cannot read .*config.json")


def test_unreadable_tokenizer(tmp_path, state, tokenizer_file):
    folder = _folder(tmp_path, state, tokenizer_file)
    (folder / "tokenizer.json").write_text("{}")
    _fails(folder, "cannot read the tokenizer in", output_layer=1)


def test_plain_folder_helper_is_a_valid_checkpoint(tmp_path, state, tokenizer_file):
    folder = plain_folder(tmp_path / "ok", state, config=qwen3_config_json(), tokenizer=tokenizer_file)
    assert check_text_encoder(folder, hidden_size=HIDDEN, output_layer=3).vocab_size <= 320


def test_a_comfy_file_in_a_folder_without_a_tokenizer_takes_the_shipped_one(tmp_path, comfy_tensors):
    from h3core.text.tokenizer import SHIPPED_NAME

    write_file(tmp_path / "text_encoders" / "qwen3vl_comfy.safetensors", comfy_tensors)
    assert check_text_encoder(tmp_path / "text_encoders", hidden_size=HIDDEN).name == SHIPPED_NAME


# --- hostile files: deep JSON, numbers in names, the tokenizer config, byte-order marks ---------------------

DEEP = "[" * 100_000 + "]" * 100_000


def _deep_case(tmp_path, state, tokenizer_file, comfy_tensors, where: str):
    """A text encoder whose `where` holds JSON nested 100,000 levels deep."""
    if where == "config.json":
        return _folder(tmp_path, state, tokenizer_file, config={"text_config": DEEP})  # (a string: rewritten below)
    if where == "header config":
        return write_file(tmp_path / "h.safetensors", comfy_tensors, metadata={"config": '{"a": ' + DEEP + "}"})
    if where == "_quantization_metadata":
        return write_file(tmp_path / "q.safetensors", comfy_tensors, metadata={comfy.LEGACY_METADATA: '{"layers": ' + DEEP + "}"})
    if where == "comfy_quant marker":
        marker = torch.tensor(list(('{"format": ' + "[" * 1000 + "]" * 1000 + "}").encode()), dtype=torch.uint8)
        return write_file(tmp_path / "m.safetensors", dict(comfy_tensors) | {"model.layers.0.mlp.up_proj.comfy_quant": marker})
    folder = _folder(tmp_path, state, tokenizer_file)
    if where == "index":
        write_shards(folder, plain_names(state), index=True)
    (folder / where).write_text('{"a": ' + DEEP + "}")
    return folder


@pytest.mark.parametrize("where", ["config.json", "header config", "_quantization_metadata", "comfy_quant marker",
                                   "model.safetensors.index.json", "tokenizer_config.json", "tokenizer.json"])
def test_deep_json_in_any_text_encoder_file_is_one_line(tmp_path, state, tokenizer_file, comfy_tensors, where):
    path = _deep_case(tmp_path, state, tokenizer_file, comfy_tensors, where)
    if where == "config.json":
        (path / "config.json").write_text('{"text_config": ' + DEEP + "}")
    message = _fails(path, "nested deeper than 100 levels|recursion limit", output_layer=1)
    assert where.split()[0].strip("_") in message or str(path) in message


def test_deep_json_in_vocab_json_is_one_line(tmp_path, state):
    from h3core.text.tokenizer import SHIPPED_FOLDER

    folder = _folder(tmp_path, state, None)
    (folder / "merges.txt").write_bytes((SHIPPED_FOLDER / "merges.txt").read_bytes())
    (folder / "vocab.json").write_text(DEEP)
    assert "vocab.json" in _fails(folder, "nested deeper than 100 levels", output_layer=1)


@pytest.mark.parametrize("layer, needle", [
    ("300000000", "'300000000' is not an index from 0 to 999,999"),
    ("100000000000000000000", "is not an index from 0 to 999,999"),
    ("9" * 5000, "(5000 characters)"),
    ("-1", "'-1' is not an index"),
    ("\u00b2", "is not an index"),
    ("\u0661", "is not an index"),  # an Arabic-Indic one, which int() and \d would read as 1
])
def test_a_layer_number_is_not_trusted(tmp_path, comfy_tensors, layer, needle):
    import time
    import tracemalloc

    tensors = dict(comfy_tensors) | {f"model.layers.{layer}.input_layernorm.weight": torch.ones(HIDDEN)}
    path = write_file(tmp_path / "comfy.safetensors", tensors)
    tracemalloc.start()
    start = time.perf_counter()
    _fails(path, needle)
    seconds, (_, peak) = time.perf_counter() - start, tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert seconds < 5 and peak < 64 << 20, (seconds, peak)


def test_a_layer_far_past_the_others_is_a_gap_found_without_counting_to_it(tmp_path, comfy_tensors):
    tensors = dict(comfy_tensors) | {"model.layers.999999.input_layernorm.weight": torch.ones(HIDDEN)}
    _fails(write_file(tmp_path / "comfy.safetensors", tensors), "lacks decoder layer 2")


TOKENIZER_CONFIGS = [
    ({"added_tokens_decoder": [1, 2]}, r"added_tokens_decoder: input should be a valid dictionary"),
    ({"added_tokens_decoder": {"abc": {"content": "x"}}}, r"added_tokens_decoder\.abc: is not a token id"),
    ({"added_tokens_decoder": {"-1": {"content": "x"}}}, r"added_tokens_decoder\.-1: is not a token id"),
    ({"added_tokens_decoder": {"9" * 5000: {"content": "x"}}}, r"is not a token id"),
    ({"added_tokens_decoder": {"4294967296": {"content": "x"}}}, r"added_tokens_decoder\.4294967296: is not a token id"),
    ({"added_tokens_decoder": {"300": {"special": True}}}, r"added_tokens_decoder\.300\.content: field required"),
    ({"added_tokens_decoder": {"300": {"content": ""}}}, r"added_tokens_decoder\.300\.content: string should have at least 1 character"),
    ({"added_tokens_decoder": {"300": "<x>"}}, r"added_tokens_decoder\.300: input should be a valid dictionary"),
    ({"added_tokens_decoder": {"300": {"content": 5}}}, r"added_tokens_decoder\.300\.content: input should be a valid string"),
    ({"added_tokens_decoder": {"300": {"content": "<x>", "lstrip": "yes"}}}, r"added_tokens_decoder\.300\.lstrip: input should be a valid boolean"),
    ({"added_tokens_decoder": {"300": {"content": "<x>", "special": 1}}}, r"added_tokens_decoder\.300\.special: input should be a valid boolean"),
    ({"additional_special_tokens": [5]}, r"additional_special_tokens\.0: input should be a valid string"),
    ({"additional_special_tokens": "<x>"}, r"additional_special_tokens: input should be a valid list"),
    ([], r"a JSON array, not an object"),
]


@pytest.mark.parametrize("config, needle", TOKENIZER_CONFIGS)
def test_a_malformed_tokenizer_config_is_one_line_naming_the_field(tmp_path, state, tokenizer_file, config, needle):
    folder = _folder(tmp_path, state, tokenizer_file)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    assert str(folder / "tokenizer_config.json") in _fails(folder, needle, output_layer=1)


def test_a_valid_tokenizer_config_adds_its_tokens(tmp_path, state, tokenizer_file):
    folder = _folder(tmp_path, state, tokenizer_file)
    config = {"added_tokens_decoder": {}, "additional_special_tokens": ["<x>", {"content": "<y>", "special": True}], "model_max_length": 10}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = check_text_encoder(folder, hidden_size=HIDDEN, output_layer=1)
    assert len(tokenizer.encode("<x><y>")) == 2


def test_every_text_encoder_file_may_start_with_a_byte_order_mark(tmp_path, state, tokenizer_file):
    """What Windows editors write: `EF BB BF` before the JSON (or text) is dropped, in every file."""
    from h3core.text.tokenizer import SHIPPED_FOLDER

    bom = b"\xef\xbb\xbf"
    folder = _folder(tmp_path, state, tokenizer_file)
    write_shards(folder, plain_names(state), index=True)
    (folder / "tokenizer_config.json").write_text(json.dumps({"additional_special_tokens": ["<x>"]}))
    for name in ("config.json", "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes(bom + (folder / name).read_bytes())
    plain = check_text_encoder(folder, hidden_size=HIDDEN, output_layer=1)
    assert len(plain.encode("<x>")) == 1
    from h3core.text.tokenizer import load_tokenizer, shipped_tokenizer

    vocab_folder = tmp_path / "vocab"
    vocab_folder.mkdir()
    for name in ("vocab.json", "merges.txt", "tokenizer_config.json"):
        (vocab_folder / name).write_bytes(bom + (SHIPPED_FOLDER / name).read_bytes())
    with_marks = load_tokenizer(vocab_folder, "with marks")
    for prompt in ("a red fox <d>hello</d>", "一只红狐狸 <|cutoff|>"):
        assert with_marks.encode(prompt) == shipped_tokenizer().encode(prompt)


def test_a_merges_line_that_is_not_a_pair_is_one_line(tmp_path, state):
    from h3core.text.tokenizer import SHIPPED_FOLDER

    folder = _folder(tmp_path, state, None)
    (folder / "vocab.json").write_bytes((SHIPPED_FOLDER / "vocab.json").read_bytes())
    (folder / "merges.txt").write_text("#version: 0.2\nĠ t\na b c\n")
    _fails(folder, r"merges.txt, line 3: 'a b c' is not two tokens", output_layer=1)
