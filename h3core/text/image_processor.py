"""Qwen's image processor (transformers' `Qwen2VLImageProcessor`, which Qwen3-VL uses) on Pillow and
torch: an RGB image -> the vision tower's flattened patches and its grid.

    processor = ImageProcessor(read_processor_config(checkpoint.processor_folders))
    pixel_values, grids = processor.pixel_values(images)   # [sum(t*h*w), C*T*P*P] float32, [(1, h, w)]
    processor.image_tokens((width, height))                # h*w / merge**2: the image's <|image_pad|> count

Per image, as transformers' PIL backend does it (`image_processing_pil_qwen2_vl.py`):

1. `smart_resize`: each side rounded to a multiple of `patch_size * merge_size` (32), the area then
   brought within `[min_pixels, max_pixels]` (H3: 65,536 .. 16,777,216) keeping the aspect; the
   image resized there with Pillow (bicubic) only if that changed its size (Pillow's resize to the
   same size is a copy). A keyframe on an H3 canvas (multiples of 32) is never resized.
2. rescale by 1/255 in float64, cast to float32; normalize `(x - mean) / std` in float32 (H3: 0.5, 0.5).
3. patches in transformers' order: `[C, H, W]` -> `(gh/m, gw/m, m, m)` patch blocks of `C x T x P x P`,
   the image repeated over the `temporal_patch_size` (2) frames, so one merged token's 4 patches
   are consecutive. The grid is `(1, H/P, W/P)`.

The numbers come from `preprocessor_config.json` beside the text encoder (the official
`FL2VA/processor/`; a Hugging Face folder's own), else the official values (`OFFICIAL`). A test
holds pixel values and grids equal to transformers' processor on several sizes.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
from PIL import Image
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from h3core.errors import CheckpointError, KeyframeError

CONFIG_FILE = "preprocessor_config.json"

PROCESSOR_TYPES = ("Qwen2VLImageProcessor", "Qwen2VLImageProcessorFast", "Qwen2VLImageProcessorPil")
"""The `image_processor_type`s whose arithmetic this is (Qwen3-VL's processor uses Qwen2-VL's)."""


class ImageProcessorConfig(BaseModel):
    """The numbers of Qwen's image processor (transformers' field names in brackets)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    patch_size: int = Field(16, gt=0, description="Side of a vision patch in pixels (`patch_size`).")
    temporal_patch_size: int = Field(2, gt=0, description="Frames per patch; an image is repeated to fill them (`temporal_patch_size`).")
    merge_size: int = Field(2, gt=0, description="Patches merged per side into one language token (`merge_size`).")
    min_pixels: int = Field(65_536, gt=0, description="Smallest area after resizing (`size.shortest_edge`).")
    max_pixels: int = Field(16_777_216, gt=0, description="Largest area after resizing (`size.longest_edge`).")
    image_mean: tuple[float, float, float] = Field((0.5, 0.5, 0.5), description="Per-channel mean subtracted after rescaling.")
    image_std: tuple[float, float, float] = Field((0.5, 0.5, 0.5), description="Per-channel divisor after the mean.")
    rescale_factor: float = Field(1 / 255, gt=0, description="Multiplies the uint8 pixels (`rescale_factor`).")
    resample: int = Field(int(Image.Resampling.BICUBIC), description="Pillow filter of the resize (`resample`; 3 = bicubic).")
    source: str = Field("official values (MiniMax-H3 FL2VA/processor/preprocessor_config.json)", description="Where these came from.")

    @property
    def factor(self) -> int:
        """Both resized sides are multiples of this."""
        return self.patch_size * self.merge_size


OFFICIAL = ImageProcessorConfig()
"""MiniMax-H3's `FL2VA/processor/preprocessor_config.json` (the transformers defaults fill what it omits)."""


def read_processor_config(folders: Sequence[Path]) -> ImageProcessorConfig:
    """The config in the first of `folders` holding `preprocessor_config.json`, else `OFFICIAL`."""
    for folder in folders:
        path = folder / CONFIG_FILE
        if path.is_file():
            return _parse(_read_json(path), path)
    return OFFICIAL


def _read_json(path: Path) -> dict[str, Any]:
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"cannot read {path}: {err}; fix it or take the model's own copy") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path} is not a JSON object; take the model's own copy")
    return raw


def _parse(raw: dict[str, Any], path: Path) -> ImageProcessorConfig:
    kind = raw.get("image_processor_type")
    if kind is not None and kind not in PROCESSOR_TYPES:
        raise CheckpointError(f"{path} describes a {kind}; h3's image processor is Qwen2-VL's ({', '.join(PROCESSOR_TYPES)})")
    for flag in ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb"):
        if raw.get(flag) is False:
            raise CheckpointError(f"{path} sets {flag} false; h3 runs Qwen's processor with every step on (resize, rescale, normalize)")
    size = raw.get("size") or {}
    fields = {name: raw[name] for name in ("patch_size", "temporal_patch_size", "merge_size", "rescale_factor", "resample") if name in raw}
    for ours, keys in (("min_pixels", ("shortest_edge", "min_pixels")), ("max_pixels", ("longest_edge", "max_pixels"))):
        stated = raw.get(ours, next((size[k] for k in keys if k in size), None))  # a top-level value wins, as in transformers
        if stated is not None:
            fields[ours] = stated
    for name in ("image_mean", "image_std"):
        if name in raw:
            fields[name] = tuple(raw[name]) if isinstance(raw[name], list) else (raw[name],) * 3
    try:
        return ImageProcessorConfig(**fields, source=str(path))
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise CheckpointError(f"{path} is not a usable Qwen image processor config: {problems}") from None


def smart_resize(height: int, width: int, config: ImageProcessorConfig) -> tuple[int, int]:
    """`(height, width)` after Qwen's resize rule (see the module docstring)."""
    factor = config.factor
    if max(height, width) / min(height, width) > 200:
        raise KeyframeError(f"an image of {width}x{height} is more than 200 times as long as it is wide; Qwen's processor refuses it")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if h_bar * w_bar > config.max_pixels:
        beta = math.sqrt((height * width) / config.max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < config.min_pixels:
        beta = math.sqrt(config.min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


class ImageProcessor:
    """Images -> `pixel_values` and grids for the vision tower (see the module docstring)."""

    def __init__(self, config: ImageProcessorConfig = OFFICIAL):
        self.config = config

    def grid(self, size: tuple[int, int]) -> tuple[int, int, int]:
        """`(t, h, w)` in patches of an image of `size` (width, height)."""
        height, width = smart_resize(size[1], size[0], self.config)
        return 1, height // self.config.patch_size, width // self.config.patch_size

    def image_tokens(self, size: tuple[int, int]) -> int:
        """The number of `<|image_pad|>` tokens (merged patches) of an image of `size` (width, height)."""
        t, h, w = self.grid(size)
        return t * h * w // self.config.merge_size**2

    def pixel_values(self, images: Sequence[Image.Image]) -> tuple[torch.Tensor, list[tuple[int, int, int]]]:
        """`[sum(t*h*w), C*T*P*P]` float32 patches of all `images` (RGB) in order, and each one's grid."""
        patches = [self._patches(self._normalized(image)) for image in images]
        grids = [self.grid(image.size) for image in images]
        return torch.cat(patches), grids

    def _normalized(self, image: Image.Image) -> torch.Tensor:  # -> [C, H, W] float32
        config = self.config
        if image.mode != "RGB":
            raise ValueError(f"the image processor takes RGB images (open keyframes with open_keyframe), got {image.mode}")
        height, width = smart_resize(image.size[1], image.size[0], config)
        if (width, height) != image.size:
            image = image.resize((width, height), resample=Image.Resampling(config.resample))
        pixels = torch.from_numpy(np.array(image)).permute(2, 0, 1)  # [C, H, W] uint8
        scaled = (pixels.double() * config.rescale_factor).float()  # as transformers: float64 product, then float32
        mean = torch.tensor(config.image_mean, dtype=torch.float32)[:, None, None]
        std = torch.tensor(config.image_std, dtype=torch.float32)[:, None, None]
        return (scaled - mean) / std

    def _patches(self, pixels: torch.Tensor) -> torch.Tensor:  # pixels: [C, H, W] -> [h*w, C*T*P*P]
        p, m, frames = self.config.patch_size, self.config.merge_size, self.config.temporal_patch_size
        channels, height, width = pixels.shape
        grid_h, grid_w = height // p, width // p
        blocks = pixels.reshape(channels, grid_h // m, m, p, grid_w // m, m, p)
        blocks = blocks.permute(1, 4, 2, 5, 0, 3, 6)  # [gh/m, gw/m, m, m, C, P, P]
        repeated = blocks.unsqueeze(5).expand(*blocks.shape[:5], frames, p, p)  # the image as T identical frames
        return repeated.reshape(grid_h * grid_w, channels * frames * p * p)
