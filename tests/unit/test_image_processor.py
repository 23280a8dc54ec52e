"""h3's Qwen image processor against transformers' own (its PIL backend: the fast one needs
torchvision): the same pixel_values (bit for bit) and grids on images that are kept, shrunk and
enlarged; and the config read from `preprocessor_config.json` as transformers reads it."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from h3core.errors import CheckpointError
from h3core.text.image_processor import OFFICIAL, ImageProcessor, read_processor_config

SIZES = [(864, 480), (480, 864), (96, 64), (333, 177), (1000, 999), (256, 1024)]
"""(width, height): an H3 canvas either way round, enlarged to min_pixels, odd sizes (shrinking: below)."""


def _image(width: int, height: int, seed: int = 0) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


def _reference(config: dict):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(**config)


OFFICIAL_JSON = {  # MiniMax-AI/MiniMax-H3 FL2VA/processor/preprocessor_config.json
    "size": {"longest_edge": 16777216, "shortest_edge": 65536}, "patch_size": 16, "temporal_patch_size": 2,
    "merge_size": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
    "processor_class": "Qwen3VLProcessor", "image_processor_type": "Qwen2VLImageProcessorFast",
}


def _compare(ours: ImageProcessor, reference, images) -> None:
    expected = reference(images=images, return_tensors="pt")
    pixel_values, grids = ours.pixel_values(images)
    assert grids == [tuple(g) for g in expected["image_grid_thw"].tolist()]
    assert pixel_values.dtype == torch.float32 and torch.equal(pixel_values, expected["pixel_values"])
    assert [ours.image_tokens(image.size) for image in images] == [int(g.prod()) // 4 for g in expected["image_grid_thw"]]


@pytest.mark.parametrize("size", SIZES)
def test_official_processor_equals_transformers(size, tmp_path):
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(OFFICIAL_JSON))
    assert read_processor_config([tmp_path]).model_dump(exclude={"source"}) == OFFICIAL.model_dump(exclude={"source"})
    reference = _reference({k: v for k, v in OFFICIAL_JSON.items() if k not in ("processor_class", "image_processor_type")})
    _compare(ImageProcessor(OFFICIAL), reference, [_image(*size)])


def test_several_images_at_once_and_a_stated_config(tmp_path):
    stated = {"min_pixels": 4096, "max_pixels": 200_000, "patch_size": 8, "merge_size": 2, "temporal_patch_size": 2,
              "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711], "resample": 2}
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(stated))
    config = read_processor_config([tmp_path / "absent", tmp_path])
    assert (config.min_pixels, config.max_pixels, config.patch_size, config.resample) == (4096, 200_000, 8, 2)
    assert config.source == str(tmp_path / "preprocessor_config.json")
    images = [_image(*size, seed=i) for i, size in enumerate([(64, 48), (640, 480), (100, 300)])]
    _compare(ImageProcessor(config), _reference(stated), images)


def test_no_config_file_gives_the_official_values(tmp_path):
    assert read_processor_config([tmp_path]) is OFFICIAL and read_processor_config([]) is OFFICIAL


def test_a_bad_config_is_one_line(tmp_path):
    path = tmp_path / "preprocessor_config.json"
    for text, words in (("{", "cannot read"), ("[1]", "not a JSON object"), ('{"patch_size": -1}', "patch_size"),
                        ('{"image_processor_type": "SiglipImageProcessor"}', "describes a SiglipImageProcessor"),
                        ('{"do_normalize": false}', "do_normalize false")):
        path.write_text(text)
        with pytest.raises(CheckpointError, match=words) as caught:
            read_processor_config([tmp_path])
        assert "\n" not in str(caught.value)
