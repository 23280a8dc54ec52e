"""The VAE files h3 reads load to exactly the weights diffusers' own loading gives.

A small random VAE of the real structure is written in each layout -- the Comfy single file
(original names; the audio VAE folded), diffusers' folder (`save_pretrained`), MiniMax's folder
(`config.json` + the original-layout file) -- and loaded by h3; the state dicts must be
bitwise diffusers' `from_pretrained` of the same weights (the audio VAE's: the weights its
weight-norm hook computes). The original layout's semantics are checked independently: one
decoder block computed from the original tensors by the MiniMax definition (per-head q|k|v rows,
SwiGLU [gate; value]) equals diffusers' block loaded by h3, and each half of the map, broken,
fails that check.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from h3core.decode import audio_vae, video_vae
from h3core.decode.load import load_vae
from h3core.decode.synthetic import CONFIGS, comfy_tensors, synthetic_model, write_comfy_file
from h3core.decode.vae_files import find_vae_files
from h3core.errors import CheckpointError
from h3core.files.safetensors import write_safetensors

SEED = 7  # not the embedded VAEs' seed: these are fresh random weights


@pytest.fixture(scope="module")
def models():
    return {role: synthetic_model(role, SEED) for role in ("video", "audio")}


@pytest.fixture(scope="module")
def written(models, tmp_path_factory):
    """Each VAE in each layout: {(role, layout): path}."""
    root = tmp_path_factory.mktemp("vaes")
    paths = {}
    for role, model in models.items():
        state = model.state_dict()
        paths[role, "comfy"] = write_comfy_file(root / f"{role}-comfy.safetensors", role, state, CONFIGS[role], {})
        model.save_pretrained(root / f"{role}-diffusers")
        paths[role, "diffusers"] = root / f"{role}-diffusers"
    minimax = root / "video_vae"
    (minimax / "source").mkdir(parents=True)
    write_safetensors(minimax / "source" / "model.safetensors", {k: v for k, v in comfy_tensors("video", models["video"].state_dict(), CONFIGS["video"]).items() if not k.startswith("latents_")})
    (minimax / "config.json").write_text(json.dumps({
        "_class_name": "MiniMaxH3VideoVAE", "source_path": "source", "source_safetensors_path": "model.safetensors",
        "latents_mean": CONFIGS["video"]["latents_mean"], "latents_std": CONFIGS["video"]["latents_std"],
    }))
    paths["video", "minimax"] = minimax
    audio = root / "audio_vae"  # MiniMax's source spells weight norm with torch.nn.utils.parametrizations
    audio.mkdir()
    spelled = {k.replace(".weight_g", ".parametrizations.weight.original0").replace(".weight_v", ".parametrizations.weight.original1"): v for k, v in models["audio"].state_dict().items()}
    write_safetensors(audio / "model.safetensors", spelled)
    (audio / "config.json").write_text(json.dumps({
        "_class_name": "MiniMaxH3AudioVAE", "source_safetensors_path": "model.safetensors",
        "latents_mean": CONFIGS["audio"]["latents_mean"], "latents_std": CONFIGS["audio"]["latents_std"],
    }))
    paths["audio", "minimax"] = audio
    return paths


def _diffusers_own(role: str, folder) -> dict[str, torch.Tensor]:
    """diffusers' from_pretrained of its own folder; the audio VAE's convolutions as its hook computes them."""
    from diffusers import AutoencoderKLMiniMaxH3, AutoencoderKLMiniMaxH3Audio

    cls = AutoencoderKLMiniMaxH3 if role == "video" else AutoencoderKLMiniMaxH3Audio
    model = cls.from_pretrained(folder)
    if role == "audio":
        audio_vae.fold_weight_norm(model)  # remove_weight_norm stores torch._weight_norm(v, g, 0): the hook's tensor
    return model.state_dict()


def _assert_bitwise(ours: dict, reference: dict) -> None:
    assert sorted(ours) == sorted(reference)
    unequal = [k for k in reference if not torch.equal(ours[k], reference[k])]
    assert unequal == []


@pytest.mark.parametrize("role, layout", [("video", "comfy"), ("video", "diffusers"), ("video", "minimax"), ("audio", "comfy"), ("audio", "diffusers"), ("audio", "minimax")])
def test_every_layout_loads_to_diffusers_own_weights(written, role, layout):
    files = find_vae_files(written[role, layout], role, "--test")
    loaded = load_vae(files, decoder_only=False)
    _assert_bitwise(loaded.model.state_dict(), _diffusers_own(role, written[role, "diffusers"]))
    assert loaded.model.config.latents_mean == pytest.approx(CONFIGS[role]["latents_mean"], rel=1e-7)
    expected = {
        "comfy": ("single file", "original" if role == "video" else "folded"),
        "diffusers": ("diffusers folder", "diffusers" if role == "video" else "weight-norm"),
        "minimax": ("MiniMax folder", "original" if role == "video" else "parametrized"),
    }
    assert (files.container, files.key_layout) == expected[layout]


def test_the_audio_vae_folds_to_the_hooks_own_tensor(models, written):
    """The folded weight h3 runs is bit for bit what diffusers' weight-norm hook computes in its forward."""
    from diffusers import AutoencoderKLMiniMaxH3Audio

    reference = AutoencoderKLMiniMaxH3Audio.from_pretrained(written["audio", "diffusers"])
    ours = load_vae(find_vae_files(written["audio", "comfy"], "audio", "--test")).model
    conv = reference.decoder.ups[3][0]
    hooked = torch._weight_norm(conv.weight_v, conv.weight_g, 0)
    assert torch.equal(ours.decoder.ups[3][0].weight, hooked)
    x = torch.randn(2, CONFIGS["audio"]["latent_channels"], 5)
    with torch.inference_mode():
        assert torch.equal(ours.decode(x).sample, reference.decode(x).sample)


def test_decoder_only_leaves_out_what_decoding_never_runs(written):
    full = load_vae(find_vae_files(written["video", "comfy"], "video", "--test"), decoder_only=False)
    decoder = load_vae(find_vae_files(written["video", "comfy"], "video", "--test"))
    assert decoder.model.encoder is None and decoder.model.quant_conv is None
    kept = {k: v for k, v in full.model.state_dict().items() if not k.startswith(video_vae.DECODER_ONLY_SKIPS)}
    _assert_bitwise(decoder.model.state_dict(), kept)
    audio = load_vae(find_vae_files(written["audio", "comfy"], "audio", "--test")).model
    assert audio.encoder is None and audio.pre_block is None and audio.mean_proj is None


# --- the original layout's meaning, from its definition -------------------------------------------------


def _original_block(t: dict[str, torch.Tensor], x: torch.Tensor, heads: int, k: int, rope: tuple) -> torch.Tensor:
    """One decoder block from the original tensors, as MiniMax's `attention.py` / `base_module.py`
    define it: q|k|v from each head's 3 * head_dim rows of `to_qkv`, SwiGLU with `w1` = [gate; value]."""
    p = f"decoder.transformer_blocks.{k}."
    cos, sin = rope

    def rms(v, w=None):
        return F.rms_norm(v.float(), (v.shape[-1],), w, 1e-5)

    def rotate(v):  # rotate-half on the first `cos.shape[-1]` channels
        r = cos.shape[-1]
        first, second = v[..., :r].chunk(2, dim=-1)
        return torch.cat([v[..., :r] * cos + torch.cat([-second, first], dim=-1) * sin, v[..., r:]], dim=-1)

    b, s, d = x.shape
    h = rms(x, t[p + "norm1.weight"])
    qkv = F.linear(h, t[p + "attn.to_qkv.weight"], t[p + "attn.to_qkv.bias"]).view(b, s, heads, -1)
    q, key, v = qkv.chunk(3, dim=-1)
    q, key = rotate(rms(q)), rotate(rms(key))
    attn = F.scaled_dot_product_attention(q.transpose(1, 2), key.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2).reshape(b, s, d)
    x = x + F.linear(attn, t[p + "attn.to_out.weight"], t[p + "attn.to_out.bias"]) * t[p + "scale1"]
    gate, value = F.linear(rms(x, t[p + "norm2.weight"]), t[p + "ff.w1.weight"], t[p + "ff.w1.bias"]).chunk(2, dim=-1)
    return x + F.linear(F.silu(gate) * value, t[p + "ff.w2.weight"], t[p + "ff.w2.bias"]) * t[p + "scale2"]


def _block_error(original: dict, loaded_model) -> float:
    heads = CONFIGS["video"]["decoder_num_attention_heads"]
    dim = original["decoder.x_embedder.weight"].shape[0]
    x = torch.randn(1, 40, dim, generator=torch.Generator().manual_seed(1))
    rope = loaded_model.decoder.rope(torch.rand(1, 40, 3) * 2 - 1)
    with torch.inference_mode():
        ours = loaded_model.decoder.transformer_blocks[1](x, rope)
        reference = _original_block(original, x, heads, 1, (rope[0], rope[1]))
    return float((ours - reference).abs().max() / reference.abs().max())


@pytest.fixture(scope="module")
def original_video(models):
    return {k: v.float() for k, v in comfy_tensors("video", models["video"].state_dict(), CONFIGS["video"]).items()}


def test_the_original_block_is_diffusers_block_after_loading(written, original_video):
    loaded = load_vae(find_vae_files(written["video", "comfy"], "video", "--test")).model
    assert _block_error(original_video, loaded) < 1e-6


@pytest.mark.parametrize("broken", ["qkv stacked instead of per head", "SwiGLU halves not swapped"])
def test_a_broken_map_fails_the_block_check(written, original_video, monkeypatch, broken):
    if broken.startswith("qkv"):
        monkeypatch.setattr(video_vae, "split_qkv", lambda fused, heads: tuple(fused.chunk(3, dim=0)))
    else:
        monkeypatch.setattr(video_vae, "swap_halves", lambda t: t)
    loaded = load_vae(find_vae_files(written["video", "comfy"], "video", "--test")).model
    assert _block_error(original_video, loaded) > 1e-2


# --- files that are not what they should be: one line each ---------------------------------------------


def test_the_other_vae_is_named(written):
    with pytest.raises(CheckpointError, match=r"is the H3 audio VAE, not the video VAE; pass it as --audio-vae"):
        find_vae_files(written["audio", "comfy"], "video", "--video-vae")
    with pytest.raises(CheckpointError, match=r"is the H3 video VAE, not the audio VAE; pass it as --video-vae"):
        find_vae_files(written["video", "diffusers"], "audio", "--audio-vae")


def test_a_transformer_file_is_not_a_vae(tmp_path):
    path = write_safetensors(tmp_path / "dit.safetensors", {"token_refiner.blocks.0.attn.qkv_proj.weight": torch.zeros(3, 2)})
    with pytest.raises(CheckpointError, match=r"is not an H3 video VAE \(it looks like the H3 transformer"):
        find_vae_files(path, "video", "--video-vae")


@pytest.mark.parametrize("content", [b"not a safetensors file", b""])
def test_a_corrupt_file_is_one_line(tmp_path, content):
    path = tmp_path / "vae.safetensors"
    path.write_bytes(content)
    with pytest.raises(CheckpointError, match=r"^--video-vae: .*vae.safetensors is not a readable safetensors file"):
        find_vae_files(path, "video", "--video-vae")


def test_a_truncated_file_is_one_line(written, tmp_path):
    data = written["video", "comfy"].read_bytes()
    path = tmp_path / "cut.safetensors"
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"^--video-vae: .*truncated"):
        find_vae_files(path, "video", "--video-vae")


def test_a_file_missing_tensors_is_one_line(written, tmp_path, models):
    tensors = comfy_tensors("video", models["video"].state_dict(), CONFIGS["video"])
    tensors.pop("decoder.transformer_blocks.1.ff.w2.weight")
    path = write_safetensors(tmp_path / "partial.safetensors", tensors)
    with pytest.raises(CheckpointError, match=r"lacks 1 tensors \(decoder.transformer_blocks.1.ff.net.2.weight\)"):
        load_vae(find_vae_files(path, "video", "--video-vae"))


def test_a_foreign_structure_is_refused(tmp_path, models):
    tensors = comfy_tensors("video", models["video"].state_dict(), CONFIGS["video"])
    tensors = {k: v for k, v in tensors.items() if not k.startswith("encoder.down.3.downsample")}
    path = write_safetensors(tmp_path / "f8.safetensors", tensors)
    with pytest.raises(CheckpointError, match="encoder level 3 lacks a downsampler"):
        load_vae(find_vae_files(path, "video", "--video-vae"))


def test_a_folder_without_config_and_a_missing_path(tmp_path):
    with pytest.raises(CheckpointError, match="is a folder without config.json"):
        find_vae_files(tmp_path, "audio", "--audio-vae")
    with pytest.raises(CheckpointError, match="does not exist; point it at the video VAE"):
        find_vae_files(tmp_path / "nope.safetensors", "video", "H3_VIDEO_VAE_PATH")


def test_latent_statistics_fall_back_to_the_published_ones(tmp_path, models):
    tensors = {k: v for k, v in comfy_tensors("audio", models["audio"].state_dict(), CONFIGS["audio"]).items() if not k.startswith("latents_")}
    path = write_safetensors(tmp_path / "no-stats.safetensors", tensors)
    loaded = load_vae(find_vae_files(path, "audio", "--audio-vae"))
    assert loaded.model.config.latents_std == list(audio_vae.PUBLISHED_LATENTS_STD)
    assert loaded.info.latents_stats_from.startswith("MiniMax's published values")


# --- hostile VAE files: deep JSON, an index leaving its folder, numbers in names, shapes ----------------------

DEEP = "[" * 100_000 + "]" * 100_000


def test_deep_json_in_a_vae_folder_is_one_line(written, tmp_path):
    import shutil

    folder = shutil.copytree(written["video", "diffusers"], tmp_path / "vae")
    config = (folder / "config.json").read_text()
    (folder / "config.json").write_text('{"block_out_channels": ' + DEEP + "}")
    with pytest.raises(CheckpointError, match=r"^cannot read the VAE's JSON file .*config.json: JSON nested deeper than 100 levels; download it again$"):
        find_vae_files(folder, "video", "--video-vae")
    (folder / "config.json").write_text("\ufeff" + config)  # a byte-order mark is no problem
    assert find_vae_files(folder, "video", "--video-vae").container == "diffusers folder"
    (folder / "diffusion_pytorch_model.safetensors.index.json").write_text('{"weight_map": {"a": "../../etc/x.safetensors"}}')
    with pytest.raises(CheckpointError, match="outside its folder"):
        find_vae_files(folder, "video", "--video-vae")


@pytest.mark.parametrize("role, name, needle", [
    ("video", "decoder.transformer_blocks.100000000000000000000.ff.w1.weight", "is not an index from 0 to 999,999"),
    ("video", "encoder.down.300000000.block.0.conv1.weight", "'300000000' is not an index"),
    ("video", "encoder.down.0.block.\u0661.conv1.weight", "is not an index"),
    ("video", "decoder.transformer_blocks.7.ff.w1.weight", "decoder.transformer_blocks.2.* is missing"),
    ("audio", f"encoder.block.{'9' * 5000}.block.4.weight", "(5000 characters)"),
    ("audio", "encoder.block.99999.block.4.weight", "the encoder's downsampling blocks are [1, 2, 3, 4, 5]"),
])
def test_numbers_in_vae_names_are_not_trusted(tmp_path, models, role, name, needle):
    tensors = comfy_tensors(role, models[role].state_dict(), CONFIGS[role]) | {name: torch.zeros(2, 2, 2)}
    path = write_safetensors(tmp_path / "v.safetensors", tensors)
    with pytest.raises(CheckpointError) as err:
        load_vae(find_vae_files(path, role, f"--{role}-vae"))
    assert needle in str(err.value) and "\n" not in str(err.value), err.value


@pytest.mark.parametrize("role, name, shape", [
    ("video", "post_quant_conv.weight", ()),
    ("video", "decoder.x_embedder.weight", (0, 4)),
    ("video", "decoder.transformer_blocks.0.ff.w1.weight", (7,)),
    ("audio", "decoder.conv_pre.weight", (4, 4)),
    ("audio", "mean_proj.weight", (0, 4, 1)),
])
def test_a_shape_a_vae_config_comes_from_is_checked_before_use(tmp_path, models, role, name, shape):
    tensors = comfy_tensors(role, models[role].state_dict(), CONFIGS[role])
    tensors[name] = torch.zeros(shape)
    path = write_safetensors(tmp_path / "v.safetensors", tensors)
    with pytest.raises(CheckpointError, match="has shape") as err:
        load_vae(find_vae_files(path, role, f"--{role}-vae"))
    assert "\n" not in str(err.value)
