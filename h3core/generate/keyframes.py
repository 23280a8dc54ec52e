"""A request's keyframes (FL2VA), settled before any rank starts, and what rank 0 makes of them.

Before a rank starts (`resolve_keyframes`, called by `h3core.generate.request.resolve`):

- each image is opened and checked (`h3core.keyframes.open_keyframe`: a missing, unreadable, oversized
  or off-aspect image is one `KeyframeError` line);
- the canvas: `--width/--height` when given (both, or neither), else the aspect of the first image
  given (the `first` keyframe, else the `last`), as diffusers' resize step does: short edge 768 and
  area at most 768 x 1344 for the `h3` presets; the small presets keep their own size scale (their
  short edge and their area: `ModelConfig.canvas_rule`), so a keyframe never turns a seconds-long
  synthetic run into a 768-pixel one. The report says which canvas and why (`Canvas.reason`);
- the text encoder must hold a vision tower, and the prompt's rows with the keyframes' vision blocks
  are counted and tagged from headers (`presented_tags`): the plan's text segments;
- the video VAE whose encoder makes their latents: `--video-vae`, else `H3_VIDEO_VAE_PATH`, else beside
  the transformer, else (a synthetic transformer only) the synthetic VAE, its header checked.

On rank 0 (`prepared_keyframes`, `encode_keyframe_latents`): the images opened again and put on
the canvas (`prepare_keyframes`: the same pixels for the vision tower and the VAE), the VAE's
encoder loaded alone, the latents made (`h3core.keyframes.latents`), the encoder released before
the denoiser loads.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field

from h3core.errors import ConfigError, KeyframeError

if TYPE_CHECKING:
    import torch
    from PIL import Image

    from h3core.model.config import ModelConfig


class Canvas(BaseModel):
    """The size a run generates at, and why."""

    model_config = ConfigDict(frozen=True)
    width: int
    height: int
    reason: str = Field(description="Where the size came from: the flags, the first keyframe's aspect, or the preset.")


class KeyframePlan(BaseModel):
    """A request's keyframes, checked before any rank starts (module docstring)."""

    model_config = ConfigDict(frozen=True)
    roles: tuple[str, ...] = Field(description="The anchors, in packed order (first, then last).")
    paths: list[str] = Field(description="Each keyframe's file, in packed order.")
    sizes: list[tuple[int, int]] = Field(description="Each file's (width, height), upright, before preparation.")
    video_vae: str | None = Field(description="The video VAE whose encoder makes the keyframe latents (None: the embedded synthetic one).")
    video_vae_source: str = Field(description="How it was found: the flag, its variable, beside the transformer, or the synthetic VAE.")


def keyframe_roles(keyframes: dict[str, Path]) -> tuple[str, ...]:
    """The roles given, in packed order (first, then last); a role other than first/last is one line."""
    from h3core.keyframes import ROLES

    unknown = sorted(set(keyframes) - set(ROLES))
    if unknown:
        raise KeyframeError(f"keyframe role {unknown[0]!r} is not one of {', '.join(ROLES)}: say first=PATH and/or last=PATH")
    return tuple(role for role in ROLES if role in keyframes)


def parse_keyframe_flags(values: list[str]) -> dict[str, Path]:
    """`--keyframe ROLE=PATH` (repeatable) -> {role: path}; a malformed value, a role other than
    first/last or one given twice is one `KeyframeError` line (exit 2)."""
    from h3core.keyframes import ROLES

    out: dict[str, Path] = {}
    for value in values:
        role, sep, path = value.partition("=")
        role = role.strip()
        if not sep or not path:
            raise KeyframeError(f"--keyframe {value!r}: give ROLE=PATH, e.g. --keyframe first=start.png (roles: {', '.join(ROLES)})")
        if role not in ROLES:
            raise KeyframeError(f"--keyframe {value!r}: role {role!r} is not one of {', '.join(ROLES)}; say first=PATH and/or last=PATH")
        if role in out:
            raise KeyframeError(f"--keyframe {role}= given twice ({out[role]} and {path}); give at most one first and one last")
        out[role] = Path(path)
    return out


# --- before any rank starts -----------------------------------------------------------------------------


def resolve_canvas(config: "ModelConfig", width: int | None, height: int | None, first_image: tuple[str, tuple[int, int]] | None) -> Canvas:
    """The run's canvas (module docstring): `first_image` is (path, size) of the first keyframe given, or None."""
    from h3core.keyframes import canvas_for

    if width is not None and height is not None:
        return Canvas(width=width, height=height, reason="--width/--height")
    if first_image is None:
        w, h = width or config.width, height or config.height
        given = "--width" if width is not None else "--height" if height is not None else None
        return Canvas(width=w, height=h, reason=f"{given} and the {config.name} preset's other side" if given else f"the {config.name} preset's size")
    if width is not None or height is not None:
        raise ConfigError("with keyframes give --width and --height together, or neither (the canvas then follows the first keyframe's aspect)")
    short, area = config.canvas_rule
    path, size = first_image
    w, h = canvas_for(size, short_edge=short, max_area=area)
    return Canvas(width=w, height=h, reason=f"the aspect of the first keyframe given ({Path(path).name}, {size[0]}x{size[1]}) at the "
                  f"{config.name} preset's short edge {short} and area at most {area:,} pixels")


def open_keyframes(keyframes: dict[str, Path]) -> list[tuple[str, "Image.Image"]]:
    """Each keyframe opened and checked (`open_keyframe`), in packed order."""
    from h3core.keyframes import open_keyframe

    return [(role, open_keyframe(keyframes[role])) for role in keyframe_roles(keyframes)]


def keyframe_vae(video_vae: Path | None, model_path: Path | None, synthetic_transformer: bool) -> tuple[str | None, str]:
    """The video VAE that encodes the keyframes (its header checked): (path or None for the synthetic one, how it was found)."""
    from h3core.decode.load import vae_config
    from h3core.decode.sources import choose_vae
    from h3core.decode.synthetic import synthetic_vae_file
    from h3core.decode.vae_files import find_vae_files

    choice = choose_vae("video", video_vae, model_path, allow_synthetic=synthetic_transformer)
    path = choice.path if choice.path is not None else synthetic_vae_file("video")[0]
    files = find_vae_files(path, "video", choice.source)
    vae_config(files, str(path))
    return (str(choice.path) if choice.path is not None else None), choice.source


def presented_tags(text_encoder: Path | None, hidden_size: int, prompt: str, canvas: tuple[int, int], count: int) -> list[int]:
    """Each text row's tag of `prompt` presented after `count` keyframes on `canvas` (1 text, 0 a vision
    block), from headers only (`check_text_encoder(images=True)`: the text encoder must hold a vision
    tower that fits its image processor, a `KeyframeError` / `CheckpointError` line otherwise)."""
    from h3core.text import check_text_encoder
    from h3core.text.encoder import image_processor_for
    from h3core.text.presentation import present

    tokenizer = check_text_encoder(text_encoder, hidden_size=hidden_size, images=True)
    tokens = image_processor_for(text_encoder).image_tokens(canvas)
    return present(tokenizer, prompt, [tokens] * count).tags


def planned_text_tags(text_tokens: int, roles: tuple[str, ...], canvas: tuple[int, int]) -> list[int]:
    """The text rows' tags of a prompt of `text_tokens` tokens presented after keyframes at `roles` on
    `canvas`, for a plan without a text encoder (`h3 plan --keyframes`): each keyframe's label (1, H3's
    tokenizer) and vision block (0, the official image processor's count), then the prompt (1)."""
    from h3core.text.image_processor import ImageProcessor
    from h3core.text.presentation import present
    from h3core.text.tokenizer import shipped_tokenizer

    blocks = present(shipped_tokenizer(), "", [ImageProcessor().image_tokens(canvas)] * len(roles)).tags
    return blocks + [1] * text_tokens


TILE = 256
"""The video VAE encodes in 256-pixel tiles (diffusers' default, on: `tile_sample_min_height/width`)."""


def encode_phase_bytes(plan: KeyframePlan, text_encoder: Path | None, hidden_size: int) -> dict[str, int]:
    """A lower bound of rank 0's device bytes while it encodes the keyframes, before the denoiser loads
    (the two phases never overlap: each encoder is released first): the video VAE's encoder and
    `quant_conv` in float32 (from the file's header) with one tile's first-level activations (three
    frames of causal padding, input and output of a convolution), or else the text encoder's vision
    tower (`vision_tower_bytes`, stored dtype), whichever is larger. The text encoder's own layers,
    loaded beside the tower, are not counted (as for a text-only run)."""
    from h3core.decode.synthetic import synthetic_vae_file
    from h3core.decode.vae_files import find_vae_files
    from h3core.text.encoder import vision_tower_bytes

    path = Path(plan.video_vae) if plan.video_vae is not None else synthetic_vae_file("video")[0]
    shapes = find_vae_files(path, "video", plan.video_vae_source).shapes
    encoder = sum(_numel(shape) for name, shape in shapes.items() if name.startswith(("encoder.", "quant_conv."))) * 4
    first = next((shape[0] for name, shape in shapes.items() if name.endswith("conv_in.weight") and name.startswith("encoder.")), 0)
    vae = {"video VAE encoder (fp32)": encoder, "VAE encode activations": 2 * 3 * first * TILE * TILE * 4}
    tower = {"vision tower": vision_tower_bytes(text_encoder, hidden_size=hidden_size)}
    return vae if sum(vae.values()) >= sum(tower.values()) else tower


H3_VISION_TOWER_BYTES = 1_190_533_600
"""Qwen3-VL-32B's vision tower as ComfyUI's text-encoder file stores it (`visual.*`, bf16; docs/keyframes.md)."""
H3_VAE_ENCODER_CHANNELS = (128, 256, 256, 512, 512, 1024)
"""The real video VAE's encoder widths (128 x (1, 2, 2, 4, 4, 8), 2 resnets per level: 180,337,888 parameters)."""


def keyframe_encode_estimate(preset_name: str) -> dict[str, dict[str, int]]:
    """`h3 plan --memory --keyframes`: rank 0's two encode phases before the denoiser loads (a lower bound,
    as `encode_phase_bytes`): for the `h3` presets H3's real video VAE encoder (its structure built on the
    meta device) and vision tower, else the embedded synthetic ones the preset runs with."""
    if not preset_name.startswith("h3"):
        from h3core.decode.synthetic import synthetic_vae_file
        from h3core.decode.vae_files import find_vae_files
        from h3core.model.config import preset
        from h3core.text.encoder import vision_tower_bytes

        shapes = find_vae_files(synthetic_vae_file("video")[0], "video", "the synthetic video VAE").shapes
        encoder = sum(_numel(v) for k, v in shapes.items() if k.startswith(("encoder.", "quant_conv."))) * 4
        width, tower = shapes["encoder.conv_in.weight"][0], vision_tower_bytes(None, hidden_size=preset(preset_name).text_dim)
    else:
        encoder, width, tower = _real_vae_encoder_bytes(), H3_VAE_ENCODER_CHANNELS[0], H3_VISION_TOWER_BYTES
    return {
        "video VAE encoder": {"encoder weights (fp32)": encoder, "encode activations": 2 * 3 * width * TILE * TILE * 4},
        "text encoder's vision tower": {"vision tower": tower},
    }


def _real_vae_encoder_bytes() -> int:
    import torch

    from h3core.decode import video_vae
    from h3core.decode.load import build_model

    config = {**video_vae.STRUCTURE, "latent_channels": 24, "block_out_channels": H3_VAE_ENCODER_CHANNELS, "layers_per_block": 2,
              "decoder_num_layers": 1, "decoder_num_attention_heads": 1, "decoder_num_register_tokens": 4, "decoder_ffn_mult": 4}
    with torch.device("meta"):
        model = build_model("video", config)
    return 4 * sum(p.numel() for name, p in model.named_parameters() if name.startswith(("encoder.", "quant_conv.")))


def _numel(shape) -> int:  # type: ignore[no-untyped-def]
    n = 1
    for size in shape:
        n *= size
    return n


# --- on rank 0 --------------------------------------------------------------------------------------------


def prepared_keyframes(plan: KeyframePlan, canvas: tuple[int, int]) -> list["Image.Image"]:
    """The keyframes opened again and put on the canvas, in packed order (the same pixels for the vision tower and the VAE)."""
    from h3core.keyframes import prepare_keyframes

    opened = open_keyframes(dict(zip(plan.roles, (Path(p) for p in plan.paths))))
    for (role, image), size in zip(opened, plan.sizes):
        if image.size != tuple(size):
            raise KeyframeError(f"the {role} keyframe changed while the run started ({image.size[0]}x{image.size[1]}, was {size[0]}x{size[1]}); run again")
    return [image for _, image in prepare_keyframes(opened, *canvas)]


def encode_keyframe_latents(plans: list[KeyframePlan], images: list[list["Image.Image"]], device: "torch.device") -> list["torch.Tensor"]:
    """For requests whose keyframes one video VAE encodes (`plans`, each with its prepared `images`), their
    normalized latents `[24, n, H/16, W/16]` (float32, CPU): the VAE's encoder loaded alone on `device`
    once, released before returning."""
    from h3core.decode.synthetic import synthetic_vae_file
    from h3core.decode.vae_files import find_vae_files
    from h3core.keyframes.latents import encode_keyframes, load_keyframe_encoder, release_keyframe_encoder

    first = plans[0]
    path = Path(first.video_vae) if first.video_vae is not None else synthetic_vae_file("video")[0]
    vae = load_keyframe_encoder(find_vae_files(path, "video", first.video_vae_source), device)
    try:
        return [encode_keyframes(vae, mine) for mine in images]
    finally:
        release_keyframe_encoder(vae)
