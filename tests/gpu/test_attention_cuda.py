"""SDPA on CUDA runs a kernel h3's rule allows at lengths that are not multiples of 128, and gives
the math reference's values. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from collections import Counter

from h3core.model.attention import attend, sdpa_choice_here

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("tokens", [1000, 1024, 14855 // 8])  # ragged, a multiple of 128, H3's share at 8 ranks
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_sdpa_takes_an_allowed_kernel_and_matches_math(tokens, dtype):
    gen = torch.Generator().manual_seed(tokens)
    qkv = torch.randn(tokens, 3 * 7 * 128, generator=gen).to("cuda", dtype)
    q, k, v = qkv.unflatten(-1, (3, 7, 128)).unbind(1)  # [S, H, Dh] strided views, as the model passes them
    record: Counter[str] = Counter()
    out = attend(q.contiguous(), k.contiguous(), v, "sdpa", record)
    torch.cuda.synchronize()
    allowed = sdpa_choice_here(dtype, 128, tokens).kernels
    (kernel,) = record
    assert kernel in allowed, (kernel, allowed)
    reference = attend(q, k, v, "math")
    tol = 1e-4 if dtype == torch.float32 else 2e-2  # fp32: the efficient kernel's own fp32 order
    assert ((out.float() - reference.float()).abs().max() / reference.float().abs().max()).item() < tol
