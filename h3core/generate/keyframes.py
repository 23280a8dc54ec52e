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
