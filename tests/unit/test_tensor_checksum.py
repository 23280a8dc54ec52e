"""`TensorChecksum`: the sha256 of a tensor's float32 bytes in C order, whatever its dtype or layout,
hashed where the bytes lie (a clip's float32 tensor is GBs: no copy of it is made for the hash)."""

from __future__ import annotations

import hashlib

import pytest
import torch

from h3core.reports.schema import TensorChecksum


def _float32_bytes(t: torch.Tensor) -> bytes:
    return t.detach().float().contiguous().numpy().tobytes()


@pytest.mark.parametrize("make", [
    lambda: torch.randn(3, 5, 7, 9),
    lambda: torch.randn(4, 6).to(torch.bfloat16),
    lambda: torch.randn(6, 8)[:, ::2],  # strided: hashed in C order
    lambda: torch.randn(5, 4).t(),
    lambda: torch.tensor(2.5),
    lambda: torch.empty(0, 3),
], ids=["float32", "bf16", "strided", "transposed", "0-d", "empty"])
def test_the_sha256_is_of_the_float32_bytes_in_c_order(make):
    t = make()
    checksum = TensorChecksum.of(t)
    assert checksum.sha256 == hashlib.sha256(_float32_bytes(t)).hexdigest()
    assert checksum.shape == list(t.shape)


def test_one_changed_value_changes_the_sha256():
    t = torch.randn(2, 3, 4)
    u = t.clone()
    u[1, 2, 3] = torch.nextafter(u[1, 2, 3], torch.tensor(float("inf")))
    assert TensorChecksum.of(t).sha256 != TensorChecksum.of(u).sha256
    assert TensorChecksum.of(t).sha256 != TensorChecksum.of(t.transpose(0, 2).contiguous()).sha256  # the same values in another order
