"""The identity of a weight file (`h3core.files.fingerprint`): cheap, cached, and changed by what
changes the weights; the modification time only where it must be (resume), not between machines."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

import h3core.files.fingerprint as fingerprint
from h3core.files.fingerprint import BLOCK_BYTES, SAMPLES, content_id, file_identity
from h3core.files.safetensors import write_safetensors


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("H3_CACHE_DIR", str(tmp_path / "cache"))
    fingerprint._memo.clear()
    yield tmp_path / "cache"
    fingerprint._memo.clear()


def _weights(path, seed, rows=4096):
    generator = torch.Generator().manual_seed(seed)
    write_safetensors(path, {"a.weight": torch.randn(rows, 64, generator=generator), "b.bias": torch.randn(64, generator=generator)}, {})
    return path


def test_other_weights_of_the_same_layout_have_another_id(tmp_path):
    first, second = _weights(tmp_path / "a.safetensors", 0), _weights(tmp_path / "b.safetensors", 1)
    assert os.path.getsize(first) == os.path.getsize(second)  # same size, same header but for the data
    assert content_id(first) != content_id(second)
    copy = tmp_path / "copy.safetensors"
    shutil.copyfile(first, copy)
    assert content_id(copy) == content_id(first)


def test_it_reads_a_bounded_amount_whatever_the_size(tmp_path, monkeypatch):
    path = tmp_path / "big.bin"
    with open(path, "wb") as f:
        f.truncate(8 << 30)  # 8 GiB, sparse
    read = []
    real_open = open

    class Counting:
        def __init__(self, f):
            self.f = f

        def read(self, n=-1):
            data = self.f.read(n)
            read.append(len(data))
            return data

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    monkeypatch.setattr(fingerprint, "open", lambda p, mode="r": Counting(real_open(p, mode)), raising=False)
    content_id(path)
    assert sum(read) <= fingerprint.HEAD_BYTES + 8 + SAMPLES * BLOCK_BYTES


def test_a_one_byte_edit_changes_the_identity_a_resume_compares(tmp_path):
    path = _weights(tmp_path / "m.safetensors", 0, rows=1 << 14)  # 4 MiB: most bytes are not sampled
    before, portable = file_identity(path), file_identity(path, portable=True)
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2 + 12345)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert file_identity(path) != before  # its modification time moved (and it is read again: its key changed)
    assert "modified_ns" not in portable


def test_copies_on_two_machines_agree_on_the_portable_identity(tmp_path):
    first = _weights(tmp_path / "a.safetensors", 0)
    copy = tmp_path / "b.safetensors"
    shutil.copyfile(first, copy)
    os.utime(copy, ns=(1, 1))  # downloaded at another time
    assert file_identity(copy, portable=True) == file_identity(first, portable=True)
    assert file_identity(copy) != file_identity(first)


def test_the_id_is_cached_by_file_state_and_a_bad_cache_entry_is_not_trusted(tmp_path, cache, monkeypatch):
    path = _weights(tmp_path / "m.safetensors", 0)
    real, calls = fingerprint._file_id, []
    monkeypatch.setattr(fingerprint, "_file_id", lambda *a: calls.append(1) or real(*a))
    first = content_id(path)
    fingerprint._memo.clear()
    assert content_id(path) == first and len(calls) == 1  # from the cache file: not read again
    (entry,) = (cache / "fingerprints").iterdir()
    data = json.loads(entry.read_text())
    entry.write_text(json.dumps({**data, "content": "forged", "key": [*data["key"][:-1], 0]}))  # another file state
    fingerprint._memo.clear()
    assert content_id(path) == first and len(calls) == 2
    entry.write_text("not json")
    fingerprint._memo.clear()
    assert content_id(path) == first and len(calls) == 3


def test_a_read_only_cache_costs_only_a_read(tmp_path, monkeypatch):
    monkeypatch.setenv("H3_CACHE_DIR", "/proc/h3-no-cache-here")
    assert len(content_id(_weights(tmp_path / "m.safetensors", 0))) == 64


def test_a_folder_is_its_files_names_and_ids(tmp_path):
    folder = tmp_path / "encoder"
    folder.mkdir()
    _weights(folder / "model.safetensors", 0)
    (folder / "config.json").write_text("{}")
    before = content_id(folder)
    (folder / "config.json").write_text('{"x": 1}')
    assert content_id(folder) != before


def test_what_cannot_be_read_says_so_without_blocking(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    assert content_id(fifo).startswith("unreadable") and content_id(tmp_path / "absent").startswith("unreadable")
