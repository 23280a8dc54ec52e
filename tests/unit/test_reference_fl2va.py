"""`h3 generate` with keyframes equals diffusers 0.42.1's FL2VA modular pipeline, from the seed alone.

Tiny random models written by the test: a MiniMax-H3 transformer (`h3_reference.SMALL`), a Qwen3-VL
with a vision tower of H3's patch geometry and 51 decoder layers (so both read `hidden_states[50]`),
and a video VAE of the real structure at small widths. diffusers runs its own `MiniMaxH3Blocks`
(resize, FL2VA text encoder, keyframe VAE encoder, layout, condition noise, latents, timesteps,
denoise) on the in-memory models; h3 runs `h3 generate`'s one call (`h3core.generate.run.generate`,
one rank in this process, `--noise-recipe diffusers`, `--no-decode`) on the same weights as files:

- `comfy`: the transformer's Comfy single file, ComfyUI's text-encoder file (`model.layers.*`,
  `visual.*`, cut after layer 50, its config in the header) and the Comfy video VAE file;
- `diffusers`: the pipeline folder (`transformer/`, `vae/` found beside it) and the official
  text-encoder folder (`text_encoder/`, `tokenizer/`).

Compared, each as max |h3 - diffusers| / max |diffusers| in float32: the prompt embeddings (the
public entry point `load_text_encoder(...).encode_prompt(prompt, images)` on the prepared keyframes)
and their tags, the condition latents (`latents.safetensors`' `condition_video` vs diffusers'
`condition_latents`), and the final video and audio latents -- for first only, last only, first +
last, and t2va. Nothing is handed over but the seed. diffusers generates at least 5 s (124 frames).
"""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
import torch

import h3_reference as ref
import qwen3_checkpoints as q

SEED, STEPS, FRAMES, SIZE = 11, 3, 124, 64
PROMPT = "the fox turns its head and runs off, wind noise"
LAYERS = 51
BOUND = 1e-5
CASES = {"first": ("first",), "last": ("last",), "first+last": ("first", "last"), "t2va": ()}


class _Processor:
    """The two things diffusers' FL2VA text step asks of `Qwen3VLProcessor` (which cannot be built here:
    its video processor needs torchvision): the image processor, and the image-token type ids."""

    def __init__(self, image_processor):
        self.image_processor = image_processor

    def create_mm_token_type_ids(self, ids):  # type: ignore[no-untyped-def]
        return [[1 if t == 151655 else 0 for t in row] for row in ids]


def _qwen3_vl():
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    rope = {"rope_type": "default", "rope_theta": q.THETA, "mrope_section": [4, 2, 2], "mrope_interleaved": True}
    text = {**q.text_fields(q.H3_VOCAB), "num_hidden_layers": LAYERS, "rope_parameters": rope}
    config = Qwen3VLConfig(text_config=text, vision_config=q.KEYFRAME_VISION, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = Qwen3VLForConditionalGeneration(config).eval()
    q._randomize(model.model.language_model)
    q.randomize_vision(model.model.visual)
    return model


@pytest.fixture(scope="module")
def models():
    from h3core.decode.synthetic import synthetic_model

    return {"transformer": ref.random_model(seed=21), "text_encoder": _qwen3_vl(), "vae": synthetic_model("video", 5)}


@pytest.fixture(scope="module")
def files(models, tmp_path_factory):
    """The same weights in the layouts h3 reads: {layout: (transformer, text encoder, video VAE or None: beside the transformer)}."""
    from h3core.decode.synthetic import CONFIGS, write_comfy_file
    from h3core.text.checkpoint import METADATA_CONFIG
    from h3core.text.tokenizer import SHIPPED_FOLDER

    root = tmp_path_factory.mktemp("fl2va-reference")
    vl, vae = models["text_encoder"], models["vae"]
    cut = vl.config.to_dict()  # ComfyUI's file: the decoder cut after layer 50 (its last is hidden_states[50], un-normed)
    cut["text_config"] = {**cut["text_config"], "num_hidden_layers": LAYERS - 1}
    comfy = (
        ref.write_single(root / "minimax_h3_tiny.safetensors", ref.original_state(models["transformer"])),
        q.write_file(root / "qwen3vl_tiny.safetensors", q.comfy_names(vl, LAYERS - 1, vision=True), {METADATA_CONFIG: json.dumps(cut)}),
        write_comfy_file(root / "minimax_h3_video_vae_tiny.safetensors", "video", vae.state_dict(), CONFIGS["video"], {}),
    )
    pipeline = root / "MiniMax-H3"
    models["transformer"].save_pretrained(pipeline / "transformer")
    vae.save_pretrained(pipeline / "vae")
    q.official_folder(pipeline, vl, SHIPPED_FOLDER, shards=2, vision=True)
    return {"comfy": comfy, "diffusers": (pipeline / "transformer", pipeline, None)}


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    """A 4:3 first keyframe and a square last one (the last is cover-cropped when both are given)."""
    from PIL import Image

    folder, rng = tmp_path_factory.mktemp("keyframes"), np.random.default_rng(0)
    paths = {}
    for role, (width, height) in (("first", (80, 60)), ("last", (64, 64))):
        paths[role] = folder / f"{role}.png"
        Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(paths[role])
    return paths


@pytest.fixture(scope="module")
def diffusers_runs(models, images):
    """diffusers' modular pipeline (every block but the decode) for each case: its prompt embeddings,
    tags, condition latents and final latents."""
    from diffusers import MiniMaxH3Scheduler
    from diffusers.modular_pipelines.minimax_h3 import MiniMaxH3Blocks
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from h3core.keyframes import open_keyframe
    from h3core.text.tokenizer import SHIPPED_FOLDER

    blocks = MiniMaxH3Blocks()
    blocks.sub_blocks.pop("decode")
    pipe = blocks.init_pipeline()
    processor = Qwen2VLImageProcessorPil(size={"shortest_edge": 65_536, "longest_edge": 16_777_216}, patch_size=16, temporal_patch_size=2,
                                         merge_size=2, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    pipe.update_components(transformer=models["transformer"], vae=models["vae"], text_encoder=models["text_encoder"],
                           tokenizer=AutoTokenizer.from_pretrained(str(SHIPPED_FOLDER)), processor=_Processor(processor),
                           scheduler=MiniMaxH3Scheduler(shift=12.0), audio_scheduler=MiniMaxH3Scheduler(shift=3.0))
    runs = {}
    for case, roles in CASES.items():
        given = {"image" if role == "first" else "last_image": open_keyframe(images[role]) for role in roles}
        outputs = ["prompt_embeds", "text_token_tags", "latents", "audio_latents"] + (["condition_latents"] if roles else [])
        out = pipe(prompt=PROMPT, **given, height=SIZE, width=SIZE, num_frames=FRAMES, num_inference_steps=STEPS,
                   generator=torch.Generator().manual_seed(SEED), output=outputs)
        runs[case] = out
    return runs


def _h3_generate(paths, roles, images, folder):
    """`h3 generate` (one rank, in this process) of the case: its latents.safetensors and report."""
    from safetensors.torch import load_file

    from h3core.generate.request import GenerateJob, GenerateRequest
    from h3core.generate.run import generate

    transformer, text_encoder, vae = paths
    request = GenerateRequest(prompt=PROMPT, model_path=transformer, text_encoder_path=text_encoder, width=SIZE, height=SIZE, frames=FRAMES,
                              steps=STEPS, seed=SEED, noise_recipe="diffusers", keyframes={role: images[role] for role in roles}, device="cpu")
    job = GenerateJob(request=request, output=folder, decode=False, video_vae=vae)
    report = generate(job)
    return load_file(str(folder / "latents.safetensors")), report


@pytest.mark.parametrize("layout, case", [("comfy", "first"), ("comfy", "last"), ("comfy", "first+last"), ("comfy", "t2va"), ("diffusers", "first+last")])
def test_h3_generate_with_keyframes_equals_diffusers_fl2va(files, images, diffusers_runs, layout, case, tmp_path):
    from h3core.generate.keyframes import prepared_keyframes
    from h3core.text import load_text_encoder

    roles, expected = CASES[case], diffusers_runs[case]
    started = time.perf_counter()
    latents, report = _h3_generate(files[layout], roles, images, tmp_path / "run")
    seconds = time.perf_counter() - started
    errors = {
        "video": ref.relative_error(latents["video"], expected["latents"][0]),
        "audio": ref.relative_error(latents["audio"], expected["audio_latents"]),
    }
    encoder = load_text_encoder(files[layout][1], hidden_size=64)  # the public entry point, on the keyframes as h3 prepares them
    pictures = prepared_keyframes(report.keyframes, (SIZE, SIZE)) if roles else []
    states, tags = encoder.encode_prompt(PROMPT, pictures)
    assert tags.tolist() == expected["text_token_tags"].tolist()
    errors["prompt_embeds"] = ref.relative_error(states, expected["prompt_embeds"][0])
    if roles:
        errors["condition"] = ref.relative_error(latents["condition_video"], torch.cat(expected["condition_latents"], dim=2)[0])
        assert report.rows["condition"] == len(roles) * (SIZE // 32) ** 2 and report.keyframes.roles == roles
    else:
        assert "condition_video" not in latents
    print(f"{layout}, {case}: " + ", ".join(f"{k} {e:.1e}" for k, e in errors.items()) + f" (h3 generate {seconds:.1f} s)")
    assert max(errors.values()) <= BOUND, errors
    assert ref.relative_error(latents["video"], torch.zeros_like(latents["video"]) + latents["video"].mean()) > 0.01  # not a constant
