"""Comfy-layout NVFP4 and int8 tensors against comfy-kitchen's own functions (its eager CPU backend):
what comfy-kitchen writes, h3 reads to the same values bit for bit, and what h3 writes, comfy-kitchen
reads back to h3's values; markers parse to typed objects, a malformed one is one line."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

import comfy_kitchen as ck
from comfy_kitchen.float_utils import to_blocked

from h3core.errors import CheckpointError, NVFP4FormatError
from h3core.files.safetensors import SafetensorsReader
from h3core.nvfp4 import comfy
from h3core.nvfp4.codec import GLOBAL_SCALE_DIVISOR, dequantize, quantize

# (out, in): aligned; pad rows (20 -> 32) and one 128-row tile; several tiles with padded scale columns
SHAPES = [(128, 64), (20, 48), (300, 144)]


def _ck_quantize(weight: torch.Tensor):
    """comfy-kitchen's NVFP4 quantization as ComfyUI writes a weight: (qdata, swizzled scales, tensor scale)."""
    global_scale = weight.abs().amax() / GLOBAL_SCALE_DIVISOR
    packed, scale = ck.quantize_nvfp4(weight, global_scale, pad_16x=True)
    return packed, scale, global_scale.float()


@pytest.mark.parametrize("out_features, in_features", SHAPES)
def test_from_comfy_decodes_what_comfy_kitchen_wrote_bit_for_bit(out_features, in_features):
    weight = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(out_features))
    packed, scale, global_scale = _ck_quantize(weight)
    rows, cols = comfy.padded_shape(out_features, in_features)
    assert tuple(packed.shape) == (rows, cols // 2)
    assert tuple(scale.shape) == comfy.scale_shape(out_features, in_features)
    ours = comfy.from_comfy(packed, scale, global_scale, out_features, in_features)
    theirs = ck.dequantize_nvfp4(packed, global_scale, scale, torch.float32)[:out_features, :in_features]
    assert torch.equal(dequantize(ours), theirs)
    # The nibble order matters: reading Comfy's bytes low-first gives another weight.
    unswapped = ours.__class__(comfy.swap_nibbles(ours.packed), ours.scale, ours.global_scale)
    assert not torch.equal(dequantize(unswapped), theirs)


@pytest.mark.parametrize("out_features, in_features", SHAPES)
def test_to_comfy_writes_what_comfy_kitchen_reads_as_our_weight(out_features, in_features):
    weight = quantize(torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(1)))
    packed, scale = comfy.to_comfy(weight)
    theirs = ck.dequantize_nvfp4(packed, weight.global_scale, scale, torch.float32)[:out_features, :in_features]
    assert torch.equal(theirs, dequantize(weight))
    assert torch.equal(scale.view(torch.uint8), to_blocked(_padded_rows(weight.scale), flatten=False).view(torch.uint8))
    back = comfy.from_comfy(packed, scale, weight.global_scale, out_features, in_features)
    assert torch.equal(back.packed, weight.packed) and torch.equal(back.scale.view(torch.uint8), weight.scale.view(torch.uint8))


def _padded_rows(scale: torch.Tensor) -> torch.Tensor:
    """The block scales of the 16-row-padded weight comfy-kitchen swizzles (pad rows: scale 0)."""
    rows = -(-scale.shape[0] // 16) * 16
    padded = torch.zeros(rows, scale.shape[1], dtype=torch.uint8)
    padded[: scale.shape[0]] = scale.view(torch.uint8)
    return padded.view(torch.float8_e4m3fn)


def test_from_comfy_refuses_a_partial_last_block_and_wrong_shapes():
    packed, scale, global_scale = _ck_quantize(torch.randn(16, 40))
    with pytest.raises(NVFP4FormatError, match="at element 40 would split a 16-element NVFP4 block"):
        comfy.from_comfy(packed, scale, global_scale, 16, 40)
    packed, scale, global_scale = _ck_quantize(torch.randn(16, 64))
    with pytest.raises(CheckpointError, match=r"of 16 x 128 stores weight \[16, 64\] .* the file has \[16, 32\]"):
        comfy.from_comfy(packed, scale, global_scale, 16, 128)


def test_markers_parse_to_typed_objects_and_round_trip():
    raw = b'{"format": "nvfp4", "full_precision_matrix_mult": true}'
    assert len(raw) == 55  # the Qwen3-VL NVFP4-AWQ file's marker length (MINIMAX_H3.md 4.3)
    quant = comfy.parse_marker(raw, "model.layers.0.mlp.up_proj.comfy_quant")
    assert (quant.format, quant.full_precision_matrix_mult, quant.convrot) == ("nvfp4", True, False)
    assert comfy.marker_tensor(quant).numpy().tobytes() == raw
    int8 = comfy.parse_marker(b'{"format": "int8_tensorwise", "convrot": true, "convrot_groupsize": 256}', "e")
    assert int8.convrot and comfy.marker_tensor(comfy.ComfyQuant("int8_tensorwise")).numel() == 29  # the file's U8[29]
    layers = comfy.legacy_markers({comfy.LEGACY_METADATA: '{"layers": {"a.b": {"format": "nvfp4"}}}'}, "f")
    assert layers["a.b"].format == "nvfp4"


@pytest.mark.parametrize(
    "raw, match",
    [
        (b"not json", "is not a JSON quantization marker"),
        (b'{"full_precision_matrix_mult": true}', "has no quantization format"),
        (b"[1, 2]", "has no quantization format"),
        (b'{"format": "nvfp4", "convrot": "yes"}', "convrot is 'yes', not true/false"),
    ],
)
def test_bad_markers_are_one_line_naming_them(raw, match):
    with pytest.raises(CheckpointError, match=match) as caught:
        comfy.parse_marker(raw, "model.layers.3.mlp.down_proj.comfy_quant")
    assert "\n" not in str(caught.value) and "model.layers.3.mlp.down_proj" in str(caught.value)


def test_int8_rows_against_comfy_kitchen():
    weight = torch.randn(37, 64) * torch.rand(37, 1) * 3
    q, scale = ck.quantize_int8_rowwise(weight)
    ours_q, ours_scale = comfy.quantize_int8_rows(weight)
    assert torch.equal(ours_q, q) and torch.equal(ours_scale, scale)
    ids = torch.tensor([0, 36, 5, 5])
    theirs = torch.ops.comfy_kitchen.dequantize_int8_embedding(q, scale, ids, 0, 0)  # group 0: no ConvRot; fp32
    assert torch.equal(comfy.dequantize_int8(q[ids], scale[ids]), theirs)
    assert torch.equal(comfy.dequantize_int8(q, scale), ck.dequantize_int8_simple(q, scale))
    tensorwise = torch.tensor(0.02)
    assert torch.equal(comfy.dequantize_int8(q, tensorwise), ck.dequantize_int8_simple(q, tensorwise))


def _write(tmp_path, tensors):
    path = tmp_path / "comfy.safetensors"
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
    return SafetensorsReader([path])


@pytest.mark.parametrize("full_precision", [True, False])
def test_read_nvfp4_linear_applies_the_awq_pre_scale_and_honours_full_precision(tmp_path, monkeypatch, full_precision):
    monkeypatch.setenv("H3_EMULATE_FP4", "1")  # an fp4 path is on offer: only the marker keeps it off
    weight = torch.randn(20, 48)
    packed, scale, global_scale = _ck_quantize(weight)
    pre_scale = torch.rand(48).add(0.5).to(torch.bfloat16)
    marker = comfy.ComfyQuant(format="nvfp4", full_precision_matrix_mult=full_precision)
    reader = _write(tmp_path, {
        "m.weight": packed, "m.weight_scale": scale, "m.weight_scale_2": global_scale,
        "m.pre_quant_scale": pre_scale, "m.comfy_quant": comfy.marker_tensor(marker),
    })
    linear = comfy.read_nvfp4_linear(reader, "m", 20, 48, comfy.parse_marker(reader.get("m.comfy_quant").numpy().tobytes(), "m"))
    assert linear.path == ("cpu-dequant" if full_precision else "cpu-fp4-emulated")
    x = torch.randn(5, 48)
    dense = ck.dequantize_nvfp4(packed, global_scale, scale, torch.float32)[:20, :48]
    expected = torch.nn.functional.linear(x * pre_scale.float(), dense)
    if full_precision:
        assert torch.equal(linear(x), expected)
    else:
        assert (linear(x) - expected).abs().max() < 0.2 * expected.abs().max()  # activations quantized too


def test_read_nvfp4_linear_names_a_tensor_of_the_wrong_layout(tmp_path):
    packed, scale, global_scale = _ck_quantize(torch.randn(128, 64))
    reader = _write(tmp_path, {"m.weight": packed, "m.weight_scale": scale[:, :2].contiguous(), "m.weight_scale_2": global_scale})
    with pytest.raises(CheckpointError, match=r"m\.weight_scale in .* is F8_E4M3 \[128, 2\], expected F8_E4M3 \[128, 4\]"):
        comfy.read_nvfp4_linear(reader, "m", 128, 64, comfy.ComfyQuant(format="nvfp4"))
