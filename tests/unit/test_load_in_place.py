"""The transformer loader converts the Comfy NVFP4 codes in the bytes it just read (issue 35.2):
`swap_nibbles_` is `swap_nibbles` done in place, and every NVFP4 linear the loader builds, whole or
a tensor-parallel shard, holds bitwise the weight the pure `from_comfy` decodes from the file."""

from __future__ import annotations

import pytest
import torch

from h3core.checkpoints.file import open_transformer
from h3core.model.checkpoint import Checkpoint, load_transformer
from h3core.model.config import preset
from h3core.model.synthetic import synthetic_checkpoint
from h3core.nvfp4 import comfy
from h3core.nvfp4.linear import NVFP4Linear
from h3core.span import Span


@pytest.mark.parametrize("strided", [False, True])
def test_the_in_place_swap_is_the_swap(strided):
    data = torch.randint(0, 256, (48, 40), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    view = data[:, :24] if strided else data
    want = comfy.swap_nibbles(view)
    pointer = view.data_ptr()
    got = comfy.swap_nibbles_(view)
    assert torch.equal(got, want) and got.data_ptr() == pointer
    assert torch.equal(comfy.swap_nibbles_(got.clone()), comfy.swap_nibbles(want))  # its own inverse, as before


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return synthetic_checkpoint(preset("tiny"), directory=tmp_path_factory.mktemp("tiny"))[0]


def _from_file(path, prefix: str, out_features: int, in_features: int):
    with open_transformer(path).reader as reader:
        return comfy.from_comfy(reader.get(f"{prefix}.weight"), reader.get(f"{prefix}.weight_scale"),
                                reader.get(f"{prefix}.weight_scale_2").float().reshape(()), out_features, in_features)


def test_every_loaded_nvfp4_linear_is_what_from_comfy_decodes(tiny):
    model = load_transformer(tiny)
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, NVFP4Linear)]
    assert linears
    for name, linear in linears:
        want = _from_file(tiny, name, linear.out_features, linear.in_features)
        got = linear.nvfp4
        assert torch.equal(got.packed, want.packed), name
        assert torch.equal(got.scale.view(torch.uint8), want.scale.view(torch.uint8)), name


def test_a_row_shard_is_the_rows_of_what_from_comfy_decodes(tiny):
    checkpoint = Checkpoint.open(tiny, preset("tiny"))
    source = checkpoint.weight_source("cpu", torch.float32)
    prefix = "blocks.0.attn.qkv_proj"
    out_features, in_features = source.shapes[prefix]
    rows = [Span(0, 16), Span(out_features - 32, out_features)]
    shard = source.linear(prefix, rows=rows)
    want = _from_file(tiny, prefix, out_features, in_features)
    assert torch.equal(shard.nvfp4.packed, torch.cat([want.packed[s.start : s.stop] for s in rows]))
