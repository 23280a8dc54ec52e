"""Crafted checkpoints, odd paths and a broken cache: one CheckpointError line each, never a crash;
the synthetic cache is derived data and is rebuilt, not reported as a download to repeat."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import h3core.model.synthetic as synthetic
from h3core.errors import CheckpointError
from h3core.model.checkpoint import Checkpoint
from h3core.model.config import preset
from h3core.model.synthetic import synthetic_checkpoint

CFG = preset("tiny")


@pytest.fixture(scope="module")
def tensors(tmp_path_factory) -> dict[str, torch.Tensor]:
    path, _ = synthetic_checkpoint(CFG, seed=0, directory=tmp_path_factory.mktemp("cache"))
    return load_file(str(path))


def _crafted(tmp_path: Path, tensors: dict, layout: str = "comfy", **changes) -> Path:
    """The tiny checkpoint (its config is always inferred from shapes), changed: a Comfy single file,
    or the official release's shards (an index, and qkv rows interleaved per head by q_norm's length)."""
    crafted = {**tensors, **{name.replace("__", "."): t for name, t in changes.items() if t is not None}}
    for name, t in changes.items():
        if t is None:
            crafted.pop(name.replace("__", "."))
    if layout == "official":
        from h3_reference import write_sharded

        return write_sharded(tmp_path / "official", crafted)
    path = tmp_path / "crafted.safetensors"
    save_file({k: v.contiguous() for k, v in crafted.items()}, str(path), metadata={"format": "pt"})
    return path


@pytest.mark.parametrize(
    "changes, needle",
    [
        ({"blocks__extra__foo": torch.zeros(2)}, "tensor 'blocks.extra.foo' is not numbered as blocks.<i>."),
        ({"video_patch_proj__weight": torch.zeros(96)}, "tensor 'video_patch_proj.weight' has shape [96], not a non-empty 2-D tensor"),
        ({"blocks__0__attn__q_norm__weight": torch.zeros(0)}, "tensor 'blocks.0.attn.q_norm.weight' has shape [0]"),
        ({"blocks__0__attn__q_norm__weight": torch.zeros(48)}, "the attention width (128) is not a multiple of 48"),
        ({"video_patch_proj__weight": torch.zeros(96, 7)}, "the video patch width (7) is not a multiple of 4"),
        ({"video_patch_proj__weight": None}, "has no tensor 'video_patch_proj.weight'"),
        ({"blocks__3__norm1__weight": torch.zeros(96)}, "blocks [2] under 'blocks.' are missing"),
    ],
)
def test_crafted_shapes_and_names_are_one_checkpoint_error(tmp_path, tensors, changes, needle):
    path = _crafted(tmp_path, tensors, **changes)
    with pytest.raises(CheckpointError) as err:
        Checkpoint.open(path, CFG)
    assert needle in str(err.value) and "\n" not in str(err.value)


# Every shape h3 derives config (or the official shards' qkv pieces) from, in both readers: absent,
# a scalar, empty, of the wrong rank, or not dividing; and every number in a name: past any sane
# count, 10^20, 5,000 digits, negative, a leading zero, a digit that is not ASCII.
SHAPES_AND_NUMBERS = [
    ({"blocks__0__attn__q_norm__weight": None}, "'blocks.0.attn.q_norm.weight'"),
    ({"blocks__0__attn__q_norm__weight": torch.tensor(1.0)}, "'blocks.0.attn.q_norm.weight' has shape []"),
    ({"blocks__0__attn__q_norm__weight": torch.zeros(0)}, "'blocks.0.attn.q_norm.weight' has shape [0]"),
    ({"blocks__0__attn__q_norm__weight": torch.zeros(2, 8)}, "'blocks.0.attn.q_norm.weight' has shape [2, 8]"),
    ({"blocks__1__attn__q_norm__weight": torch.zeros(0)}, "'blocks.1.attn.q_norm.weight' has shape [0]"),
    ({"rope__inv_freq": torch.tensor(1.0)}, "'rope.inv_freq' has shape []"),
    ({"rope__inv_freq": torch.zeros(0)}, "'rope.inv_freq' has shape [0]"),
    ({"rope__inv_freq": torch.zeros(1, 2)}, "'rope.inv_freq' has shape [1, 2]"),
    ({"blocks__0__attn__qkv_proj__weight": torch.tensor(1, dtype=torch.uint8)}, "blocks.0.attn.qkv_proj.weight"),
    ({"blocks__0__attn__qkv_proj__weight": torch.zeros(0, 48, dtype=torch.uint8)}, "blocks.0.attn.qkv_proj"),
    ({"blocks__0__attn__qkv_proj__weight": torch.zeros(7, 48, dtype=torch.uint8)}, "blocks.0.attn.qkv_proj"),
    ({"blocks__0__attn__out_proj__weight": torch.tensor(1.0)}, "'blocks.0.attn.out_proj.weight' has shape []"),
    ({"condition_proj__weight": torch.zeros(96)}, "'condition_proj.weight' has shape [96]"),
    ({"adaln_t_table": torch.zeros(0, 8)}, "'adaln_t_table' has shape [0, 8]"),
    ({"blocks__0__attn__qkv_proj__weight_scale_2": torch.ones(2)}, "weight_scale_2"),
    ({"blocks__0__attn__qkv_proj__weight_scale_2": None}, "weight_scale_2"),
    ({"blocks__0__mlp__fc1__weight_scale": torch.zeros(3, dtype=torch.float8_e4m3fn)}, "fc1.weight_scale"),
    ({"blocks__300000000__norm1__weight": torch.zeros(96)}, "'300000000' is not an index from 0 to 999,999"),
    ({"blocks__100000000000000000000__norm1__weight": torch.zeros(96)}, "is not an index from 0 to 999,999"),
    ({"token_refiner__blocks__100000000000000000000__norm1__weight": torch.zeros(96)}, "token_refiner.blocks.<i>."),
    ({f"blocks__{'9' * 5000}__norm1__weight": torch.zeros(96)}, "(5000 characters)"),
    ({"blocks__-1__norm1__weight": torch.zeros(96)}, "'-1' is not an index"),
    ({"blocks__01__norm1__weight": torch.zeros(96)}, "'01' is not an index"),
    ({"blocks__\u00b2__norm1__weight": torch.zeros(96)}, "is not an index"),  # superscript two: int() refuses it
    ({"blocks__\u0661__norm1__weight": torch.zeros(96)}, "is not an index"),  # Arabic-Indic one: int() reads it as 1
    ({"blocks__5__norm1__weight": torch.zeros(96)}, "blocks [2, 3, 4] under 'blocks.' are missing (the largest is 5)"),
]


@pytest.mark.parametrize("layout", ["comfy", "official"])
@pytest.mark.parametrize("changes, needle", SHAPES_AND_NUMBERS)
def test_every_shape_and_number_a_config_comes_from_is_checked_before_use(tmp_path, tensors, layout, changes, needle):
    import time
    import tracemalloc

    changes = {name.encode().decode("unicode_escape"): t for name, t in changes.items()}
    path = _crafted(tmp_path, tensors, layout, **changes)
    tracemalloc.start()
    start = time.perf_counter()
    with pytest.raises(CheckpointError) as err:
        Checkpoint.open(path, CFG).validate()  # what `resolve` does before any rank starts
    seconds, (_, peak) = time.perf_counter() - start, tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert needle in str(err.value) and "\n" not in str(err.value), err.value
    assert seconds < 5 and peak < 64 << 20, (seconds, peak)  # no range up to a number, no tensor read to find it


def test_shapes_that_make_an_invalid_config_are_one_checkpoint_error(tmp_path, tensors):
    # a residual width of 100 is no multiple of 16: ModelConfig refuses it
    with pytest.raises(CheckpointError, match="its tensor shapes describe no valid H3 model"):
        Checkpoint.open(_crafted(tmp_path, tensors, video_patch_proj__weight=torch.zeros(100, 96)), CFG)


def test_a_folder_fifo_or_device_as_model_says_what_it_is(tmp_path):
    os.mkfifo(tmp_path / "pipe")
    cases = [(tmp_path, "holds no *.safetensors files"), (tmp_path / "pipe", "is a FIFO (named pipe), not a file"),
             (Path("/dev/null"), "is a character device, not a file"), (tmp_path / "absent", "H3 checkpoint not found")]
    for path, needle in cases:
        done: list[BaseException] = []
        worker = threading.Thread(target=lambda p=path: _open_into(p, done), daemon=True)
        worker.start()
        worker.join(5)  # opening a FIFO would block forever: it must never be opened
        assert done and isinstance(done[0], CheckpointError) and needle in str(done[0]), (path, done)


def _open_into(path: Path, done: list) -> None:
    try:
        Checkpoint.open(path, CFG)
    except BaseException as err:  # noqa: BLE001 - the test inspects it
        done.append(err)


# --- deep and malformed JSON in every reader of a transformer checkpoint -----------------------------------

DEEP = "[" * 100_000 + "]" * 100_000


def _header_file(path: Path, header: bytes) -> Path:
    path.write_bytes(len(header).to_bytes(8, "little") + header)
    return path


def _marker(text: str) -> torch.Tensor:
    return torch.tensor(list(text.encode()), dtype=torch.uint8)


def test_deep_or_malformed_json_in_each_checkpoint_reader_is_one_line(tmp_path, tensors):
    from h3_reference import write_sharded

    cases = {}
    cases["header"] = _header_file(tmp_path / "deep.safetensors", ('{"a": ' + DEEP + "}").encode())
    cases["header numbers"] = _header_file(tmp_path / "digits.safetensors", b'{"a": {"dtype": "F32", "shape": [' + b"9" * 5000 + b'], "data_offsets": [0, 4]}}')
    cases["header bom"] = _header_file(tmp_path / "bom.safetensors", b"\xef\xbb\xbf" + b"[" * 200 + b"]" * 200)
    official = write_sharded(tmp_path / "index", tensors)
    (official / "model.safetensors.index.json").write_text('{"weight_map": ' + DEEP + "}")
    cases["shard index"] = official
    diffusers = tmp_path / "diffusers"
    diffusers.mkdir()
    save_file({"transformer_blocks.0.attn.to_q.weight": torch.zeros(2, 2)}, str(diffusers / "diffusion_pytorch_model.safetensors"))
    (diffusers / "config.json").write_text('{"rope_theta": ' + DEEP + "}")
    cases["config.json"] = diffusers
    marked = dict(tensors) | {"blocks.0.attn.qkv_proj.comfy_quant": _marker('{"format": ' + "[" * 5000 + "]" * 5000 + "}")}
    save_file(marked, str(tmp_path / "marker.safetensors"))
    cases["comfy_quant marker"] = tmp_path / "marker.safetensors"
    save_file(tensors, str(tmp_path / "legacy.safetensors"), metadata={"_quantization_metadata": '{"layers": ' + DEEP + "}"})
    cases["_quantization_metadata"] = tmp_path / "legacy.safetensors"
    for what, path in cases.items():
        with pytest.raises(CheckpointError) as err:
            Checkpoint.open(path, CFG)
        message = str(err.value)
        assert "\n" not in message and str(path) in message, (what, message)
        assert "nested deeper than 100 levels" in message or "a number of 5000 characters" in message, (what, message)


def test_a_marker_larger_than_any_marker_is_refused_before_it_is_read(tmp_path, tensors):
    from h3core.nvfp4.comfy import MAX_MARKER_BYTES

    marked = dict(tensors) | {"blocks.0.attn.qkv_proj.comfy_quant": torch.zeros(MAX_MARKER_BYTES + 1, dtype=torch.uint8)}
    save_file(marked, str(tmp_path / "big.safetensors"))
    with pytest.raises(CheckpointError, match=f"comfy_quant holds {MAX_MARKER_BYTES + 1:,} bytes, a marker at most"):
        Checkpoint.open(tmp_path / "big.safetensors", CFG)


def test_an_index_of_the_wrong_form_or_escaping_its_folder_is_one_line(tmp_path, tensors):
    from h3_reference import write_sharded

    folder = write_sharded(tmp_path / "official", tensors)
    index = folder / "model.safetensors.index.json"
    for text, needle in [("[]", "a JSON array, not an object"), ('{"weight_map": []}', "its weight_map is not a map"),
                         ('{"weight_map": {}}', "its weight_map is not a map"), ('{"weight_map": {"a": 1}}', "its weight_map is not a map"),
                         ('{"weight_map": {"a": "/etc/passwd"}}', "outside its folder"), ('{"weight_map": {"a": "../x.safetensors"}}', "outside its folder"),
                         ("\ufeff" + index.read_text(), None)]:
        index.write_text(text)
        if needle is None:
            assert Checkpoint.open(folder, CFG).config.hidden == CFG.hidden  # a byte-order mark is not a problem
            continue
        with pytest.raises(CheckpointError, match=needle):
            Checkpoint.open(folder, CFG)


def test_a_fifo_as_text_encoder_says_what_it_is(tmp_path):
    from h3core.text import check_text_encoder

    os.mkfifo(tmp_path / "encoder")
    with pytest.raises(CheckpointError, match="is a FIFO \\(named pipe\\), not a file or folder"):
        check_text_encoder(tmp_path / "encoder", hidden_size=64)


# --- the synthetic cache ---------------------------------------------------------------------------


def test_a_corrupt_or_foreign_cached_file_is_rebuilt(tmp_path):
    path, built = synthetic_checkpoint(CFG, seed=0, directory=tmp_path)
    good = {k: v.clone() for k, v in load_file(str(path)).items()}  # load_file maps the file: copy before changing it
    path.write_bytes(path.read_bytes()[:1000])  # truncated
    again, built = synthetic_checkpoint(CFG, seed=0, directory=tmp_path)
    assert again == path and built and _same({k: v.clone() for k, v in load_file(str(path)).items()}, good)
    foreign = CFG.model_copy(update={"steps": 7}).model_dump_json()
    save_file(good, str(path), metadata={"format": "pt", "h3_weights": "synthetic", "h3_config": foreign})  # readable, another config's
    assert synthetic_checkpoint(CFG, seed=0, directory=tmp_path)[1]
    assert Checkpoint.open(path, CFG).config.hidden == CFG.hidden and not synthetic_checkpoint(CFG, seed=0, directory=tmp_path)[1]


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8)) for k in a)


def test_an_unwritable_or_full_cache_folder_is_one_line(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match=r"cannot write the synthetic checkpoint \([\d.]+ [KMG]?i?B\) to the cache folder .*: .*; set H3_CACHE_DIR"):
        synthetic_checkpoint(CFG, seed=0, directory=tmp_path / "file" / "cache")
    monkeypatch.setattr(synthetic, "free_bytes", lambda folder: 0)
    with pytest.raises(CheckpointError, match="no space left on the device; set H3_CACHE_DIR to a writable folder"):
        synthetic_checkpoint(CFG, seed=0, directory=tmp_path / "full")
    assert not list((tmp_path / "full").glob("*.safetensors"))
