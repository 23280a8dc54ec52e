"""NVFP4 linears in safetensors: ModelOpt names, lazy slices equal to loaded slices, bytes read, clear errors."""

from __future__ import annotations

import ctypes
import json
import mmap
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from h3core.errors import CheckpointError
from h3core.files.safetensors import SafetensorsReader, write_safetensors
from h3core.nvfp4.codec import dequantize
from h3core.nvfp4.io import iter_prefixes, linear_tensors, read_linear
from h3core.nvfp4.layout import ColumnSlice
from h3core.nvfp4.linear import NVFP4Linear
from h3core.nvfp4.shard import column_parallel, row_parallel
from h3core.parallel.partition import fused_qkv_rows, head_spans, nvfp4_column_slices
from h3core.span import Span


def make_linear(out: int, inp: int, seed: int, extras: bool = True) -> NVFP4Linear:
    gen = torch.Generator().manual_seed(seed)
    base = NVFP4Linear.from_float(torch.randn(out, inp, generator=gen), torch.randn(out, generator=gen).bfloat16())
    if not extras:
        return base
    return NVFP4Linear(base.nvfp4, base.bias, torch.rand(inp, generator=gen).bfloat16() + 0.5, torch.tensor(0.02))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> tuple[Path, dict[str, NVFP4Linear]]:
    linears = {
        "blocks.0.attn.qkv": make_linear(3 * 64, 64, 0),
        "blocks.0.mlp.fc2": make_linear(64, 208, 1, extras=False),
    }
    tensors = {k: v for prefix, lin in linears.items() for k, v in linear_tensors(prefix, lin).items()}
    path = tmp_path_factory.mktemp("ckpt") / "model.safetensors"
    write_safetensors(path, tensors, {"h3_config": '{"preset": "tiny"}'})
    return path, linears


def assert_same_linear(a: NVFP4Linear, b: NVFP4Linear) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert set(sa) == set(sb)
    for key in sa:
        ta, tb = sa[key], sb[key]
        assert ta.dtype == tb.dtype, key
        if ta.dtype == torch.float8_e4m3fn:
            ta, tb = ta.view(torch.uint8), tb.view(torch.uint8)
        assert torch.equal(ta, tb), key


def test_tensors_carry_modelopt_names_and_dtypes(checkpoint):
    path, _ = checkpoint
    reader = SafetensorsReader([path])
    names = ("weight", "weight_scale", "weight_scale_2", "bias", "pre_quant_scale", "input_scale")
    assert {k for k in reader.keys() if k.startswith("blocks.0.attn.qkv.")} == {f"blocks.0.attn.qkv.{n}" for n in names}
    assert reader.dtype_name("blocks.0.attn.qkv.weight") == "U8"
    assert reader.dtype_name("blocks.0.attn.qkv.weight_scale") == "F8_E4M3"
    assert reader.shape("blocks.0.attn.qkv.weight_scale_2") == ()
    assert reader.metadata == {"h3_config": '{"preset": "tiny"}'}
    assert sorted(iter_prefixes(reader)) == ["blocks.0.attn.qkv", "blocks.0.mlp.fc2"]


def test_whole_linear_round_trips(checkpoint):
    path, linears = checkpoint
    for prefix, original in linears.items():
        loaded = read_linear(SafetensorsReader([path]), prefix)
        assert_same_linear(loaded, original)
        x = torch.randn(3, original.in_features)
        assert torch.equal(loaded(x), original(x))


@pytest.mark.parametrize("world", [1, 3, 4])
def test_lazy_rows_equal_column_parallel_of_the_full_linear(checkpoint, world):
    path, linears = checkpoint
    full = linears["blocks.0.attn.qkv"]
    for heads in head_spans(4, world):
        rows = fused_qkv_rows(heads, 4, 16)
        reader = SafetensorsReader([path])
        shard = read_linear(reader, "blocks.0.attn.qkv", rows=rows)
        assert_same_linear(shard, column_parallel(full, rows))
        n = sum(len(s) for s in rows)
        # only the rows: packed + scales + bias(bf16), plus the whole pre-scale(bf16) and two f32 scalars
        assert reader.bytes_read == n * (32 + 4 + 2) + 64 * 2 + 4 + 4


@pytest.mark.parametrize("world", [1, 2, 5, 8])
def test_lazy_columns_equal_row_parallel_of_the_full_linear(checkpoint, world):
    path, linears = checkpoint
    full = linears["blocks.0.mlp.fc2"]
    for cols in nvfp4_column_slices(208, world):
        reader = SafetensorsReader([path])
        shard = read_linear(reader, "blocks.0.mlp.fc2", columns=cols)
        expected, bias = row_parallel(full, cols)
        assert_same_linear(shard, expected)
        assert shard.bias is None and torch.equal(reader.get("blocks.0.mlp.fc2.bias"), bias)
        assert reader.bytes_read == 64 * (len(cols.packed_bytes) + len(cols.scale_columns)) + 4 + 64 * 2


def test_reader_slices_equal_slices_of_loaded_tensors(checkpoint):
    path, _ = checkpoint
    reader = SafetensorsReader([path])
    name = "blocks.0.mlp.fc2.weight_scale"
    full = reader.get(name).view(torch.uint8)
    rows = reader.get_rows(name, [Span(3, 9), Span(40, 41)]).view(torch.uint8)
    assert torch.equal(rows, torch.cat([full[3:9], full[40:41]]))
    cols = reader.get_columns(name, Span(2, 7)).view(torch.uint8)
    assert cols.is_contiguous() and torch.equal(cols, full[:, 2:7])
    pre = "blocks.0.attn.qkv.pre_quant_scale"
    assert torch.equal(reader.get_columns(pre, Span(16, 48)), reader.get(pre)[16:48])


def test_sharded_checkpoint_with_index(tmp_path, checkpoint):
    _, linears = checkpoint
    names = {}
    for i, (prefix, lin) in enumerate(linears.items()):
        tensors = linear_tensors(prefix, lin)
        write_safetensors(tmp_path / f"part-{i}.safetensors", tensors)
        names.update({k: f"part-{i}.safetensors" for k in tensors})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": names}))
    reader = SafetensorsReader.open(tmp_path)
    assert len(reader.paths) == 2
    for prefix, original in linears.items():
        assert_same_linear(read_linear(reader, prefix), original)


# --- bytes actually read from disk --------------------------------------------------------------


def page_cache_bytes(path: Path) -> int:
    """Bytes of `path` in the page cache (mincore over a fresh mapping)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    size, page = path.stat().st_size, mmap.PAGESIZE
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        vec = (ctypes.c_ubyte * ((size + page - 1) // page))()
        ok = libc.mincore(ctypes.c_void_p(addr), size, vec) == 0
        libc.munmap(ctypes.c_void_p(addr), size)
    finally:
        os.close(fd)
    if not ok:  # mincore on a fresh shared mapping of a regular file fails only on a broken call
        raise OSError(ctypes.get_errno(), f"mincore over {path} failed")
    return sum(v & 1 for v in vec) * page


def evict(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def readahead_bytes(path: Path) -> int:
    """The block device's read-ahead window for `path` (128 KiB if sysfs does not say)."""
    dev = path.stat().st_dev
    block = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
    for candidate in (block / "queue" / "read_ahead_kb", block.parent / "queue" / "read_ahead_kb"):
        if candidate.exists():
            return int(candidate.read_text()) * 1024
    return 128 * 1024


def write_sparse_linear(
    path: Path, rows: int, width: int, data_rows: Span, packed: torch.Tensor, scale: torch.Tensor
) -> None:
    """A safetensors file, written by hand from the format spec, of a linear `rows x width` whose bytes
    are holes except rows `data_rows`: gigabytes on paper, a few MiB on disk, written in milliseconds."""
    packed_size, scale_size = rows * width // 2, rows * width // 16
    scale_end = packed_size + scale_size
    header = {
        "big.weight": {"dtype": "U8", "shape": [rows, width // 2], "data_offsets": [0, packed_size]},
        "big.weight_scale": {"dtype": "F8_E4M3", "shape": [rows, width // 16], "data_offsets": [packed_size, scale_end]},
        "big.weight_scale_2": {"dtype": "F32", "shape": [], "data_offsets": [scale_end, scale_end + 4]},
    }
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    base = 8 + len(raw)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        f.seek(base + data_rows.start * (width // 2))
        f.write(packed.numpy().tobytes())
        f.seek(base + packed_size + data_rows.start * (width // 16))
        f.write(scale.view(torch.uint8).numpy().tobytes())
        f.seek(base + packed_size + scale_size)
        f.write(torch.tensor(1.0).numpy().tobytes())
        os.fsync(f.fileno())


@pytest.mark.skipif(not hasattr(os, "posix_fadvise") or not Path("/proc/self/maps").exists(), reason="needs Linux")
def test_a_row_shard_reads_about_its_own_bytes_from_disk(tmp_path):
    # A 1.1 GiB (sparse) checkpoint of one 131072 x 16384 linear; rank 2 of 128 owns 1024 rows: 9 MiB.
    # Evict the file from the page cache, read the shard, and count the file's pages the kernel brought
    # in: the slice, plus at most one read-ahead window that safe_open's header check (a memory map)
    # may start at the head of the file. The slice reads themselves are exact (pread, no read-ahead).
    rows, width, mine = 131072, 16384, Span(2048, 3072)
    packed = (torch.arange(len(mine) * width // 2, dtype=torch.int32) % 251).to(torch.uint8).view(len(mine), width // 2)
    scale = torch.full((len(mine), width // 16), 2.0).to(torch.float8_e4m3fn)
    path = tmp_path / "big.safetensors"
    write_sparse_linear(path, rows, width, mine, packed, scale)
    evict(path)
    ahead = readahead_bytes(path)
    if page_cache_bytes(path) > 1 << 20:
        pytest.skip("this filesystem does not drop pages on request (tmpfs?); the OS-level count would mean nothing")
    file_size = path.stat().st_size
    if ahead > file_size // 4:
        pytest.skip(f"read-ahead windows of {ahead >> 20} MiB are too large for this file to tell slice from file")

    reader = SafetensorsReader([path])
    shard = read_linear(reader, "big", rows=[mine])
    on_disk = page_cache_bytes(path)

    slice_bytes = len(mine) * (width // 2 + width // 16)
    assert reader.bytes_read == slice_bytes + 4
    assert torch.equal(shard.weight, packed)
    assert torch.equal(shard.weight_scale.view(torch.uint8), scale.view(torch.uint8))
    report = f"{on_disk >> 20} MiB of a {file_size >> 20} MiB file in memory for a {slice_bytes >> 20} MiB slice"
    assert slice_bytes <= on_disk <= slice_bytes + ahead + (1 << 20), report


# --- errors -------------------------------------------------------------------------------------


def test_missing_file(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        SafetensorsReader([tmp_path / "nope.safetensors"])


def test_empty_folder(tmp_path):
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        SafetensorsReader.open(tmp_path)


def test_truncated_file_names_the_file(tmp_path, checkpoint):
    path, _ = checkpoint
    broken = tmp_path / "broken.safetensors"
    broken.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=r"broken\.safetensors.*truncated"):
        SafetensorsReader([broken])


def test_garbage_file(tmp_path):
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"\xff" * 64)
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        SafetensorsReader([garbage])


def test_missing_tensor_names_key_and_file(checkpoint):
    path, _ = checkpoint
    with pytest.raises(CheckpointError, match=r"blocks\.9\.attn\.qkv\.weight is not in .*model\.safetensors"):
        read_linear(SafetensorsReader([path]), "blocks.9.attn.qkv")


def test_duplicate_tensor_across_shards(tmp_path, checkpoint):
    path, _ = checkpoint
    copy = tmp_path / "copy.safetensors"
    copy.write_bytes(path.read_bytes())
    with pytest.raises(CheckpointError, match="is in both"):
        SafetensorsReader([path, copy])


def write_broken(tmp_path: Path, **changes: torch.Tensor) -> SafetensorsReader:
    tensors = linear_tensors("lin", make_linear(32, 64, 5))
    tensors.update({f"lin.{k}": v for k, v in changes.items()})
    path = tmp_path / "broken.safetensors"
    save_file(tensors, str(path))
    return SafetensorsReader([path])


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(weight_scale=torch.ones(32, 4)), r"weight_scale .* is F32 .*expected F8_E4M3"),
        (dict(weight_scale=torch.ones(32, 5).to(torch.float8_e4m3fn)), r"\[32, 5\], expected F8_E4M3 \[32, 4\]"),
        (dict(weight_scale=torch.ones(31, 4).to(torch.float8_e4m3fn)), r"expected F8_E4M3 \[32, 4\]"),
        (dict(weight=torch.zeros(32, 32, dtype=torch.int8)), r"weight .* is I8"),
        (dict(weight=torch.zeros(32, 12, dtype=torch.uint8)), r"multiple of 16"),
        (dict(weight_scale_2=torch.ones(2)), r"weight_scale_2 .* expected F32 \[\]"),
        (dict(weight_scale_2=torch.tensor(1.0, dtype=torch.float64)), r"weight_scale_2 .* is F64"),
        (dict(bias=torch.zeros(31)), r"bias .* expected F16/BF16/F32/F64 \[32\]"),
        (dict(pre_quant_scale=torch.zeros(32)), r"pre_quant_scale .* \[64\]"),
        (dict(weight_scale_2=torch.tensor(0.0)), "positive and finite"),
        (dict(weight_scale=torch.full((32, 4), float("nan")).to(torch.float8_e4m3fn)), "NaN block scales"),
    ],
)
def test_inconsistent_tensors_are_refused(tmp_path, changes, message):
    with pytest.raises(CheckpointError, match=message):
        read_linear(write_broken(tmp_path, **changes), "lin")


def test_scalar_scales_stored_as_one_element_vectors_are_accepted(tmp_path):
    reader = write_broken(tmp_path, weight_scale_2=torch.tensor([0.01]), input_scale=torch.tensor([0.5]))
    linear = read_linear(reader, "lin")
    assert linear.weight_scale_2.shape == () and linear.input_scale.shape == ()


def test_rows_out_of_range_and_unaligned_columns(checkpoint):
    path, _ = checkpoint
    reader = SafetensorsReader([path])
    with pytest.raises(CheckpointError, match="exceed"):
        read_linear(reader, "blocks.0.attn.qkv", rows=[Span(0, 500)])
    with pytest.raises(CheckpointError, match="split a 16-element"):
        read_linear(reader, "blocks.0.mlp.fc2", columns=ColumnSlice(Span(0, 24)))
    with pytest.raises(CheckpointError, match="out of range"):
        reader.get_columns("blocks.0.mlp.fc2.weight", Span(0, 1000))
    with pytest.raises(ValueError, match="not both"):
        read_linear(reader, "blocks.0.mlp.fc2", rows=[Span(0, 1)], columns=ColumnSlice(Span(0, 16)))


def test_a_closed_reader_refuses_to_read(checkpoint):
    path, _ = checkpoint
    with SafetensorsReader([path]) as reader:
        reader.get("blocks.0.mlp.fc2.weight_scale_2")
    with pytest.raises(ValueError, match="closed"):
        reader.get("blocks.0.mlp.fc2.weight_scale_2")


def test_write_is_atomic(tmp_path, monkeypatch):
    import h3core.files.safetensors as safetensors_files

    def failing_save(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(safetensors_files, "save_file", failing_save)
    with pytest.raises(OSError):
        write_safetensors(tmp_path / "out.safetensors", {"x": torch.zeros(1)})
    assert list(tmp_path.iterdir()) == []


def test_dequantized_lazy_shard_is_the_slice_of_the_dequantized_full(checkpoint):
    path, linears = checkpoint
    cols = nvfp4_column_slices(208, 5)[1]
    shard = read_linear(SafetensorsReader([path]), "blocks.0.mlp.fc2", columns=cols)
    full = dequantize(linears["blocks.0.mlp.fc2"].nvfp4)
    assert torch.equal(dequantize(shard.nvfp4), full[:, cols.elements.start : cols.elements.stop])


def test_reader_agrees_with_safe_open_for_every_dtype(tmp_path):
    from safetensors import safe_open

    tensors = {
        "u8": torch.randint(0, 256, (7, 10), dtype=torch.uint8),
        "f8": torch.randn(5, 6).to(torch.float8_e4m3fn),
        "bf16": torch.randn(9).bfloat16(),
        "f32_scalar": torch.tensor(0.125),
        "f16": torch.randn(3, 4).half(),
    }
    path = tmp_path / "mixed.safetensors"
    write_safetensors(path, tensors)
    reader = SafetensorsReader([path])
    with safe_open(str(path), framework="pt") as handle:
        for name in tensors:
            ours, theirs = reader.get(name), handle.get_tensor(name)
            assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
            assert torch.equal(ours.reshape(-1).view(torch.uint8), theirs.reshape(-1).view(torch.uint8)), name
    assert reader.bytes_read == sum(t.numel() * t.element_size() for t in tensors.values())
