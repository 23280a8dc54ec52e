"""Hostile LoRA files and scales (issue 36, the new surfaces): a lying safetensors header is the
checkpoint reader's one line, every tensor and number of an adapter is checked before a rank starts
(non-finite values, ranks that disagree or are no low rank, an alpha of the wrong form or an absurd
alpha / rank, integer matrices, keys that target no linear), its metadata is read by h3's one JSON
reader, and a strength is a finite number within ±100 wherever a request gives one."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import load_file, save_file

from h3core.errors import AdapterError
from h3core.lora.adapter import open_adapter
from h3core.lora.spec import MAX_SCALE, lora_spec, parse_lora
from h3core.lora.synthetic import write_synthetic_adapter
from h3core.model.config import preset

CFG = preset("tiny")
DOWN = "diffusion_model.blocks.0.attn.out_proj.lora_down.weight"
UP = "diffusion_model.blocks.0.attn.out_proj.lora_up.weight"
ALPHA = "diffusion_model.blocks.0.attn.out_proj.alpha"


@pytest.fixture(scope="module")
def kohya(tmp_path_factory) -> Path:
    """A rank-4 kohya adapter (alpha tensors) on every block linear of the tiny model."""
    return write_synthetic_adapter(tmp_path_factory.mktemp("lora") / "kohya.safetensors", CFG, rank=4, alpha=4.0)


@pytest.fixture(scope="module")
def peft(tmp_path_factory) -> Path:
    return write_synthetic_adapter(tmp_path_factory.mktemp("lora") / "peft.safetensors", CFG, rank=4, fmt="peft")


def _edited(src: Path, dst: Path, edit=None, metadata: dict[str, str] | None = None) -> Path:
    """`src` with its tensors passed through `edit` and its metadata updated by `metadata` (None: dropped)."""
    from h3core.files.safetensors import read_header

    tensors = load_file(str(src))
    tensors = edit(tensors) if edit else tensors
    _, _, meta = read_header(src)
    meta = {**meta, **(metadata or {})}
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dst), metadata={k: v for k, v in meta.items() if v is not None})
    return dst


def _refused(path: Path, needle: str) -> str:
    with pytest.raises(AdapterError) as caught:
        open_adapter(path, CFG)
    message = str(caught.value)
    assert "\n" not in message and needle in message and caught.value.exit_code == 2, message
    assert len(message) < 600, message  # one line a person reads, whatever the file holds
    return message


def _with(name: str, value: torch.Tensor):
    return lambda t: {**t, name: value}


# --- the file itself: the checkpoint reader's checks ------------------------------------------------------------


def _lying(path: Path, src: Path, change) -> Path:
    raw = src.read_bytes()
    length = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + length])
    change(header)
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + length:])
    return path


def test_a_lying_or_odd_file_is_the_checkpoint_readers_one_line(tmp_path, kohya):
    def grow(h):
        h[DOWN]["data_offsets"][1] += 10**9

    def overlap(h):
        h[UP]["data_offsets"] = h[DOWN]["data_offsets"]

    def shape(h):
        h[DOWN]["shape"] = [4, 10**12]

    (tmp_path / "empty.safetensors").write_bytes(b"")
    (tmp_path / "huge-header.safetensors").write_bytes(struct.pack("<Q", 2**60) + b"{}")
    (tmp_path / "deep.safetensors").write_bytes(struct.pack("<Q", 200_000) + b"[" * 100_000 + b"]" * 100_000)
    os.mkfifo(tmp_path / "fifo.safetensors")
    cases = {
        _lying(tmp_path / "grow.safetensors", kohya, grow): "in the header holds 1000002048 bytes, not the 2048",
        _lying(tmp_path / "overlap.safetensors", kohya, overlap): "overlap",
        _lying(tmp_path / "shape.safetensors", kohya, shape): "",
        tmp_path / "empty.safetensors": "the header length is not valid",
        tmp_path / "huge-header.safetensors": "header",
        tmp_path / "deep.safetensors": "JSON nested deeper than 100 levels",
        tmp_path / "fifo.safetensors": "is a FIFO (named pipe), not a file",
        Path("/dev/zero"): "is a character device, not a file",
        tmp_path: "holds no pytorch_lora_weights.safetensors",
    }
    for path, needle in cases.items():
        _refused(path, needle)


# --- values, ranks, alphas, dtypes --------------------------------------------------------------------------------


@pytest.mark.parametrize("key", [DOWN, UP, ALPHA])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_values_in_any_tensor_are_refused(tmp_path, kohya, key, bad):
    def poison(t):
        t[key] = t[key].clone().reshape(-1)
        t[key][-1] = bad
        t[key] = t[key].reshape(load_file(str(kohya))[key].shape)
        return t

    _refused(_edited(kohya, tmp_path / "bad.safetensors", poison), "not a finite number" if key == ALPHA else "holds NaN or infinite values")


def test_ranks_that_disagree_or_are_no_low_rank_are_refused(tmp_path, kohya, peft):
    tensors = load_file(str(kohya))
    _refused(_edited(kohya, tmp_path / "a.safetensors", _with(UP, tensors[UP][:, :3])), "rank mismatch on blocks.0.attn.out_proj")
    _refused(_edited(peft, tmp_path / "b.safetensors", _with("transformer.transformer_blocks.0.attn.to_out.0.lora_B.weight",
                                                             torch.zeros(CFG.hidden, 5))), "rank mismatch")
    width, rows = tensors[DOWN].shape[1], tensors[UP].shape[0]  # out_proj: attention width in, hidden out
    over = min(width, rows) + 1  # a rank past both is no low-rank pair
    huge = {DOWN: torch.zeros(over, width), UP: torch.zeros(rows, over)}
    _refused(_edited(kohya, tmp_path / "c.safetensors", lambda t: {**t, **huge}), f"has rank {over}, more than its {width} inputs or {rows} outputs")
    full = {DOWN: torch.zeros(rows, width), UP: torch.zeros(rows, rows)}
    assert rows in open_adapter(_edited(kohya, tmp_path / "d.safetensors", lambda t: {**t, **full}), CFG).ranks  # full rank: allowed


@pytest.mark.parametrize(
    "alpha, needle",
    [
        (torch.ones(3), "must be one number, got F32 [3]"),
        (torch.ones(0), "must be one number, got F32 [0]"),
        (torch.ones(2, 2), "must be one number, got F32 [2, 2]"),
        (torch.tensor(True), "must be one number, got BOOL []"),
        (torch.tensor(1e6), "alpha / rank = 2.5e+05 (rank 4), outside ±100"),
        (torch.tensor(-1e30), "outside ±100"),
    ],
)
def test_an_alpha_of_the_wrong_form_or_size_is_refused(tmp_path, kohya, alpha, needle):
    _refused(_edited(kohya, tmp_path / "alpha.safetensors", _with(ALPHA, alpha)), needle)


def test_an_alpha_of_one_element_in_any_shape_is_read_as_kohya_writes_it(tmp_path, kohya):
    adapter = open_adapter(_edited(kohya, tmp_path / "alpha.safetensors", _with(ALPHA, torch.full((1, 1), 2.0))), CFG)
    assert next(p.scale for p in adapter.pairs if p.keys.alpha == ALPHA) == 0.5


@pytest.mark.parametrize("dtype", [torch.int8, torch.int32, torch.int64, torch.uint8, torch.bool, torch.float8_e4m3fn])
def test_matrices_that_are_not_float_are_refused_by_their_dtype(tmp_path, kohya, dtype):
    tensors = load_file(str(kohya))
    _refused(_edited(kohya, tmp_path / "int.safetensors", _with(DOWN, tensors[DOWN].to(dtype))), "LoRA matrices are float")


def test_keys_that_target_no_linear_are_named_three_at_most_and_cut_short(tmp_path, kohya):
    tensors = load_file(str(kohya))
    stray = {f"diffusion_model.blocks.{n}.attn.qkv_proj.lora_down.weight": tensors[DOWN].clone() for n in (99, 10**12, int("9" * 500))}
    stray["diffusion_model.blocks.7.mlp.fc1.lora_down.weight"] = tensors[DOWN].clone()
    message = _refused(_edited(kohya, tmp_path / "stray.safetensors", lambda t: {**t, **stray}), "4 of its")
    assert "the first 'diffusion_model.blocks." in message and "(and 1 more)" in message and "9" * 200 not in message
    _refused(_edited(kohya, tmp_path / "other.safetensors", lambda t: {f"lora_te_text_model.{i}.weight": torch.zeros(1) for i in range(9)}),
             "no key names a linear of the MiniMax-H3 transformer (e.g. 'lora_te_text_model.0.weight'")


# --- metadata: h3's JSON reader, numbers and patterns checked -------------------------------------------------------


def _peft_meta(**config) -> dict[str, str]:
    return {"lora_adapter_metadata": json.dumps({"r": 4, "lora_alpha": 4, **config})}


@pytest.mark.parametrize(
    "metadata, needle",
    [
        ({"lora_adapter_metadata": "[" * 50_000 + "]" * 50_000}, "JSON nested deeper than 100 levels"),
        ({"lora_adapter_metadata": '{"r": ' + "9" * 5000 + "}"}, "a number of 5000 characters"),
        ({"lora_adapter_metadata": "[4, 4]"}, "not an object"),
        ({"lora_adapter_metadata": '{"r": 4, "lora_alpha": Infinity}'}, "no finite numeric 'lora_alpha'"),
        ({"lora_adapter_metadata": '{"r": true, "lora_alpha": 4}'}, "no finite numeric 'r'"),
        (_peft_meta(rank_pattern={"(": 3}), "rank_pattern key '(' is not a regular expression"),
        (_peft_meta(alpha_pattern={"blocks": "x"}), "alpha_pattern['blocks'] is 'x', not a finite number"),
        (_peft_meta(alpha_pattern=["blocks"]), "alpha_pattern is a JSON list"),
        (_peft_meta(rank_pattern={"a" * 2000: 3}), "longer than 1000 characters"),
        (_peft_meta(alpha_pattern={"(.*a)+$": 3}), "a repeated group, which can take exponential time"),
        (_peft_meta(rank_pattern={"(\\w|\\w){30}x": 3}), "a repeated group"),
        (_peft_meta(lora_alpha=1e9), "outside ±100"),
        ({"h3.video_sigmas": "[" * 50_000 + "]" * 50_000}, "h3.video_sigmas must be a JSON list"),
    ],
)
def test_malformed_metadata_is_one_line(tmp_path, peft, metadata, needle):
    _refused(_edited(peft, tmp_path / "meta.safetensors", metadata=metadata), needle)


def test_module_patterns_as_peft_writes_them_still_apply(tmp_path, peft):
    meta = _peft_meta(rank_pattern={"transformer_blocks.0.attn.to_out.0": 4}, alpha_pattern={"transformer_blocks\\.1.*": 8, "to_(q|k|v)": 2})
    scales = {p.keys.module: p.scale for p in open_adapter(_edited(peft, tmp_path / "patterns.safetensors", metadata=meta), CFG).pairs}
    assert scales["transformer_blocks.1.ff.net.2"] == 2.0 and scales["transformer_blocks.0.attn.to_q"] == 0.5
    assert scales["transformer_blocks.0.ff.net.2"] == 1.0


def test_a_file_wide_alpha_that_is_absurd_is_refused(tmp_path, peft):
    plain = _edited(peft, tmp_path / "plain.safetensors", metadata={"lora_adapter_metadata": None})
    _refused(_edited(plain, tmp_path / "nan.safetensors", metadata={"alpha": "nan"}), "is not a finite number")
    _refused(_edited(plain, tmp_path / "huge.safetensors", metadata={"alpha": "1e30"}), "outside ±100")
    assert open_adapter(_edited(plain, tmp_path / "fine.safetensors", metadata={"alpha": "8"}), CFG).pairs[0].scale == 2.0


# --- the user's strength: one rule for the flag, the API, a JSONL line and the server ------------------------------


@pytest.mark.parametrize("text", ["a.safetensors:nan", "a.safetensors:inf", "a.safetensors:-inf", "a.safetensors:1e308",
                                  "a.safetensors:-1e9", "a.safetensors:100.5", "a.safetensors:0x10", "a.safetensors:"])
def test_a_flag_scale_that_is_not_a_finite_number_within_the_bound_is_one_line(text):
    with pytest.raises(AdapterError) as caught:
        parse_lora(text)
    assert "\n" not in str(caught.value) and str(caught.value).startswith(f"--lora {text}:")


def test_the_bound_itself_and_small_scales_are_taken():
    for scale in (MAX_SCALE, -MAX_SCALE, 0.0, 1e-30):
        assert parse_lora(f"a.safetensors:{scale!r}").scale == scale
        assert lora_spec(("a.safetensors", scale)).scale == scale


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), 1e300, -101.0, True, "0.8", None])
def test_an_api_scale_of_the_wrong_type_or_size_is_one_line(scale):
    with pytest.raises(AdapterError, match="is not a finite number within ±100"):
        lora_spec(("a.safetensors", scale))


@pytest.mark.parametrize("scale", ["true", "1e999", "200", "-100.01", '"0.8"'])
def test_a_jsonl_or_server_scale_of_the_wrong_type_or_size_is_refused(tmp_path, scale):
    from h3core.batch.prompts import read_prompts
    from h3core.errors import ConfigError
    from h3core.serve.api import VideoCreate

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(f'{{"prompt": "a fox", "loras": [{{"path": "a.safetensors", "scale": {scale}}}]}}\n')
    with pytest.raises(ConfigError, match="line 1: loras.0.scale"):
        read_prompts(prompts)
    with pytest.raises(ValidationError):
        VideoCreate.model_validate_json(f'{{"prompt": "a fox", "loras": [{{"path": "/a.safetensors", "scale": {scale}}}]}}', strict=True)
