"""Keyframes through the text encoder, against transformers 5.24's Qwen3-VL on the same tiny random
weights (fp32): the vision tower alone (merged rows and deepstack features), and `encode_prompt`
with 1 and 2 images -- the `<Picture i>: ` presentation, the tower, 3-axis M-RoPE, deepstack --
against `Qwen3VLModel`'s `hidden_states[k]`, from the official / HF folder and from ComfyUI's single
file. A text-only request reads no byte of the tower; every keyframe refusal is one line."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image
from qwen3_checkpoints import (
    HIDDEN,
    KEYFRAME_VISION,
    LAYERS,
    comfy_names,
    max_relative_error,
    official_folder,
    plain_folder,
    qwen3_config_json,
    qwen3_vl_keyframe_model,
    random_qwen3_state,
    train_tokenizer,
    write_file,
)

from h3core.errors import CheckpointError, ConfigError
from h3core.files.safetensors import SafetensorsReader
from h3core.keyframes import KeyframeError
from h3core.text import check_text_encoder, load_text_encoder
from h3core.text.checkpoint import METADATA_CONFIG
from h3core.text.config import Qwen3VisionConfig
from h3core.text.encoder import image_processor_for, vision_tower_bytes
from h3core.text.image_processor import ImageProcessor
from h3core.text.tokenizer import SHIPPED_FOLDER

TOLERANCE = 1e-5  # max |h3 - transformers| / max |transformers|, float32
PROMPT = "the fox turns its head and runs off, wind noise <d>[English] Go!</d>"
SIZES = [(256, 256), (320, 192)]  # (width, height): 64 and 77 image tokens with the official processor


@pytest.fixture(scope="module")
def vl():
    return qwen3_vl_keyframe_model(seed=0)


@pytest.fixture(scope="module")
def images():
    rng = np.random.default_rng(0)
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for w, h in SIZES]


@pytest.fixture(scope="module")
def reference_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(SHIPPED_FOLDER))


def _reference_processor(min_pixels: int = 65_536):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(size={"shortest_edge": min_pixels, "longest_edge": 16_777_216}, patch_size=16,
                                    temporal_patch_size=2, merge_size=2, image_mean=[0.5] * 3, image_std=[0.5] * 3)


def _reference_states(vl, tokenizer, processor, prompt: str, images) -> tuple[tuple[torch.Tensor, ...], list[int]]:
    """diffusers' MiniMaxH3FL2VATextEncoderStep + get_qwen3vl_prompt_embeds on transformers' model: every
    hidden state (the last one un-normed, read off the last layer) and the tags."""
    vision = processor(images=images, return_tensors="pt")
    ids, tags = [], []
    for index, grid in enumerate(vision["image_grid_thw"]):
        label = tokenizer(f"<Picture {index + 1}>: ", add_special_tokens=False)["input_ids"]
        block = [151652] + [151655] * (int(grid.prod()) // 4) + [151653]
        ids, tags = ids + label + block, tags + [1] * len(label) + [0] * len(block)
    text = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    ids, tags = ids + text, tags + [1] * len(text)
    input_ids = torch.tensor([ids])
    captured = []
    hook = vl.model.language_model.layers[-1].register_forward_hook(lambda m, a, out: captured.append(out))
    try:
        with torch.no_grad():
            out = vl.model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), mm_token_type_ids=(input_ids == 151655).long(),
                           pixel_values=vision["pixel_values"], image_grid_thw=vision["image_grid_thw"], use_cache=False,
                           output_hidden_states=True)
    finally:
        hook.remove()
    last = captured[0][0] if isinstance(captured[0], tuple) else captured[0]
    return tuple(h[0] for h in out.hidden_states[:-1]) + (last[0],), tags


# --- the vision tower alone ---------------------------------------------------------------------------


def test_vision_tower_equals_transformers(vl, images, tmp_path):
    path = write_file(tmp_path / "comfy.safetensors", comfy_names(vl, LAYERS, vision=True), {METADATA_CONFIG: json.dumps(vl.config.to_dict())})
    encoder = load_text_encoder(path, hidden_size=HIDDEN)
    spec, tower = encoder.vision_tower()
    assert spec.config == Qwen3VisionConfig(**{**KEYFRAME_VISION, "deepstack_visual_indexes": (0, 2)})
    pixel_values, grids = ImageProcessor().pixel_values(images)
    with torch.no_grad():
        expected = vl.model.visual(pixel_values, grid_thw=torch.tensor(grids), return_dict=True)
    embeds, deepstack = tower(pixel_values, grids)
    errors = [max_relative_error(embeds, expected.pooler_output)]
    errors += [max_relative_error(ours, theirs) for ours, theirs in zip(deepstack, expected.deepstack_features, strict=True)]
    assert embeds.shape == (sum(h * w for _, h, w in grids) // 4, HIDDEN) and max(errors) <= TOLERANCE, errors
    print(f"vision tower vs transformers: max relative error {max(errors):.2e} (merged rows, 2 deepstack features)")


# --- encode_prompt against Qwen3VLModel ---------------------------------------------------------------


@pytest.fixture(scope="module")
def comfy_file(tmp_path_factory, vl):
    """ComfyUI's layout (`model.layers.*`, `visual.*`, no final norm) of the whole tiny model, its HF
    config in the header (a config-less file is only readable with H3's own tower shapes)."""
    path = tmp_path_factory.mktemp("comfy") / "qwen3vl_tiny.safetensors"
    return write_file(path, comfy_names(vl, LAYERS, vision=True), {METADATA_CONFIG: json.dumps(vl.config.to_dict())})


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory, vl):
    """The official layout with the tower, and FL2VA/processor/ stating a smaller min_pixels (so it is read)."""
    root = official_folder(tmp_path_factory.mktemp("official") / "FL2VA", vl, SHIPPED_FOLDER, vision=True)
    (root / "processor").mkdir()
    (root / "processor" / "preprocessor_config.json").write_text(json.dumps({
        "size": {"longest_edge": 16777216, "shortest_edge": 16384}, "patch_size": 16, "temporal_patch_size": 2,
        "merge_size": 2, "image_mean": [0.5] * 3, "image_std": [0.5] * 3, "image_processor_type": "Qwen2VLImageProcessorFast",
    }))
    return root


@pytest.mark.parametrize("layout", ["comfy", "official"])
@pytest.mark.parametrize("count", [1, 2])
def test_encode_prompt_equals_transformers(layout, count, vl, images, reference_tokenizer, comfy_file, hf_folder):
    path, min_pixels = (comfy_file, 65_536) if layout == "comfy" else (hf_folder, 16_384)
    expected, expected_tags = _reference_states(vl, reference_tokenizer, _reference_processor(min_pixels), PROMPT, images[:count])
    errors = {}
    for layer in range(LAYERS + 1):  # the embedding (image rows spliced in), before/after each deepstack addition, the last layer
        encoder = load_text_encoder(path, hidden_size=HIDDEN, output_layer=layer)
        states, tags = encoder.encode_prompt(PROMPT, images[:count])
        assert states.dtype == torch.float32 and tags.tolist() == expected_tags
        errors[layer] = max_relative_error(states, expected[layer])
    assert max(errors.values()) <= TOLERANCE, errors
    info = encoder.info
    assert info.vision and info.vision_resident_bytes > 0 and info.images == count
    if layout == "official":
        assert image_processor_for(path).config.min_pixels == 16_384
    print(f"{layout}, {count} image(s), {states.shape[0]} rows: max relative error per layer " + ", ".join(f"{k}: {e:.1e}" for k, e in errors.items()))


def test_encode_prompt_runs_in_bfloat16(comfy_file, images):
    encoder = load_text_encoder(comfy_file, hidden_size=HIDDEN, dtype=torch.bfloat16)
    states, tags = encoder.encode_prompt(PROMPT, images)
    reference, _ = load_text_encoder(comfy_file, hidden_size=HIDDEN).encode_prompt(PROMPT, images)
    assert states.dtype == torch.bfloat16 and torch.isfinite(states).all()
    assert max_relative_error(states.float(), reference) < 0.05  # bf16 rounding, not a different computation


# --- what is read, and when --------------------------------------------------------------------------


def test_a_text_only_request_reads_no_vision_byte(vl, tmp_path, comfy_file):
    without = {k: v for k, v in comfy_names(vl, LAYERS, vision=True).items() if not k.startswith("visual.")}
    bare = write_file(tmp_path / "no_tower.safetensors", without, {METADATA_CONFIG: json.dumps(vl.config.to_dict())})
    read: list[str] = []
    original = SafetensorsReader._fill
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(SafetensorsReader, "_fill", lambda self, name, *a: read.append(name) or original(self, name, *a))
        with_tower = load_text_encoder(comfy_file, hidden_size=HIDDEN)
        states, _ = with_tower.encode_prompt(PROMPT)
        assert not [name for name in read if name.startswith("visual.")]
    plain = load_text_encoder(bare, hidden_size=HIDDEN)
    assert torch.equal(states, plain.encode_prompt(PROMPT)[0])
    assert with_tower.info.bytes_read == plain.info.bytes_read and with_tower.info.vision_resident_bytes == 0
    assert with_tower.has_vision and not plain.has_vision
    tower_bytes = sum(v.numel() * v.element_size() for k, v in comfy_names(vl, LAYERS, vision=True).items() if k.startswith("visual."))
    before = with_tower.info.bytes_read
    with_tower.encode_prompt(PROMPT, [Image.new("RGB", (256, 256), (200, 30, 30))])
    assert with_tower.info.bytes_read - before >= tower_bytes  # the tower is read when keyframes come, whole
    assert with_tower.info.vision_resident_bytes == tower_bytes == vision_tower_bytes(comfy_file, hidden_size=HIDDEN)
    assert vision_tower_bytes(bare, hidden_size=HIDDEN) == 0
    with_tower.release()
    assert with_tower._vision is None


# --- refusals: one line each -------------------------------------------------------------------------


def _one_line(error: BaseException) -> str:
    assert "\n" not in str(error) and isinstance(error, ConfigError)
    return str(error)


def test_keyframes_with_an_encoder_without_a_tower_are_one_line(tmp_path):
    folder = plain_folder(tmp_path / "qwen3", random_qwen3_state(), config=qwen3_config_json(), tokenizer=train_tokenizer(tmp_path / "tok.json"))
    encoder = load_text_encoder(folder, hidden_size=HIDDEN, output_layer=-1)
    assert not encoder.has_vision and not encoder.info.vision
    image = Image.new("RGB", (256, 256))
    with pytest.raises(KeyframeError, match="keyframes need a text encoder with Qwen3-VL's vision tower") as caught:
        encoder.encode_prompt("a fox", [image])
    _one_line(caught.value)
    with pytest.raises(KeyframeError, match="has none"):
        check_text_encoder(folder, hidden_size=HIDDEN, output_layer=-1, images=True)
    assert check_text_encoder(folder, hidden_size=HIDDEN, output_layer=-1).encode("a fox")  # text-only stays fine


def test_a_bad_tower_is_found_from_headers(vl, tmp_path, images):
    config = json.dumps(vl.config.to_dict())
    tensors = comfy_names(vl, LAYERS, vision=True)
    broken = {k: v for k, v in tensors.items() if k != "visual.blocks.1.attn.proj.bias"}
    path = write_file(tmp_path / "broken.safetensors", broken, {METADATA_CONFIG: config})
    with pytest.raises(CheckpointError, match="lacks tensor visual.blocks.1.attn.proj.bias") as caught:
        check_text_encoder(path, hidden_size=HIDDEN, images=True)
    _one_line(caught.value)
    check_text_encoder(path, hidden_size=HIDDEN)  # text-only requests never look at the tower
    load_text_encoder(path, hidden_size=HIDDEN).encode_prompt(PROMPT)
    headerless = write_file(tmp_path / "headerless.safetensors", tensors)
    with pytest.raises(CheckpointError, match="does not state its vision tower's heads and deepstack layers, and its tower is not H3's"):
        load_text_encoder(headerless, hidden_size=HIDDEN).encode_prompt(PROMPT, images[:1])
    wrong = json.loads(config)
    wrong["vision_config"]["num_heads"] = 3
    odd = write_file(tmp_path / "odd.safetensors", tensors, {METADATA_CONFIG: json.dumps(wrong)})
    with pytest.raises(CheckpointError, match="not a valid Qwen3-VL vision tower: .*heads"):
        check_text_encoder(odd, hidden_size=HIDDEN, images=True)


def test_a_processor_that_does_not_fit_the_tower_is_one_line(hf_folder, tmp_path):
    import shutil

    root = shutil.copytree(hf_folder, tmp_path / "FL2VA")
    (root / "processor" / "preprocessor_config.json").write_text(json.dumps({"patch_size": 14}))
    with pytest.raises(CheckpointError, match="patches of 14 px .* the vision tower of .* takes 16 px") as caught:
        check_text_encoder(root, hidden_size=HIDDEN, output_layer=-1, images=True)
    _one_line(caught.value)


def test_too_many_tokens_with_images_is_one_line(comfy_file, images):
    encoder = load_text_encoder(comfy_file, hidden_size=HIDDEN)
    with pytest.raises(ConfigError, match=r"with its 2 keyframe\(s\) is \d+ tokens, more than the 100") as caught:
        encoder.encode_prompt(PROMPT, images, max_tokens=100)
    _one_line(caught.value)
    assert encoder.info.vision_resident_bytes == 0  # refused from the sizes: the tower was not read


def test_the_comparison_catches_1d_positions_and_a_misplaced_deepstack(vl, images, reference_tokenizer, comfy_file, monkeypatch):
    """Mutations: text positions for the image tokens, or the deepstack features one layer late, move
    the states far past the tolerance (so the equality above means something)."""
    import h3core.text.encoder as encoder_module
    from h3core.text.model import VisualRows

    expected, _ = _reference_states(vl, reference_tokenizer, _reference_processor(), PROMPT, images[:1])
    encoder = load_text_encoder(comfy_file, hidden_size=HIDDEN)
    with monkeypatch.context() as patch:
        patch.setattr(encoder_module, "multimodal_positions", lambda length, *a: torch.arange(length).expand(3, -1))
        positions_error = max_relative_error(encoder.encode_prompt(PROMPT, images[:1])[0], expected[LAYERS])
    with monkeypatch.context() as patch:
        original = VisualRows.after_layer
        patch.setattr(VisualRows, "after_layer", lambda self, h, index: original(self, h, index - 1) if index else h)
        deepstack_error = max_relative_error(encoder.encode_prompt(PROMPT, images[:1])[0], expected[LAYERS])
    assert min(positions_error, deepstack_error) > 100 * TOLERANCE, (positions_error, deepstack_error)
    print(f"mutations: 1-D positions {positions_error:.2e}, deepstack one layer late {deepstack_error:.2e}")
