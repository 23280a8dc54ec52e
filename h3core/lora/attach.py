"""Putting a request's adapters on a loaded (and parallelized) model, and taking them off again.

`attach_adapters(model, adapters, dtype)` builds, for every linear any adapter adapts, one
`LowRankBranch` from all of its pairs (each scaled by the user's scale times its `alpha / rank`), in
the dtype that linear computes in, on its device, cut as tensor mode cut the linear
(`h3core.lora.tensor.cut_for`), and hangs it on the linear (`linear.lora`). The linear's own
tensors are never touched: taking the branches off (`detach_adapters`) gives the model back bit for
bit, which is how a resident rank serves requests with different adapters without reloading the
base (`h3core.generate.pipeline.RankPipeline.use_adapters`).

Under a fake-tensor mode (the dry run of `h3core.generate.dryrun`) nothing is read: the matrices are
empty tensors of their shapes, so the prediction counts them.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Sequence

import torch
from torch import nn

from h3core.lora.adapter import AdapterFile, Pair
from h3core.lora.branch import LowRankBranch, stack_pairs
from h3core.lora.tensor import cut_for
from h3core.nvfp4.linear import DenseLinear, NVFP4Linear


def attach_adapters(model: nn.Module, adapters: Sequence[tuple[AdapterFile, float]], dtype: torch.dtype) -> int:
    """Every adapter's branches on `model` (replacing any already there), each pair scaled by its
    adapter's user scale; NVFP4 linears' branches in `dtype`, dense ones' in their weight's dtype.
    Returns the bytes the branches hold on this rank."""
    detach_adapters(model)
    by_target: dict[str, list[tuple[torch.Tensor, torch.Tensor, object, float]]] = defaultdict(list)
    for adapter, scale in adapters:
        for pair, down, up in _matrices(adapter):
            by_target[pair.target].append((down, up, pair.keys.rows, scale * pair.scale))
    held = 0
    for target, pairs in sorted(by_target.items()):
        linear = model.get_submodule(target)
        assert isinstance(linear, (DenseLinear, NVFP4Linear)), f"{target} is {type(linear).__name__}, not a linear"
        branch_dtype = linear.weight.dtype if isinstance(linear, DenseLinear) else dtype
        linear.lora = cut_for(linear, stack_pairs(pairs, branch_dtype, linear.weight.device))  # type: ignore[arg-type]
        held += linear.lora.nbytes
    return held


def detach_adapters(model: nn.Module) -> None:
    """Take every branch off `model`: its linears compute exactly what they did before any was attached."""
    for module in model.modules():
        if isinstance(module, (DenseLinear, NVFP4Linear)) and module.lora is not None:
            module.lora = None


def branches(model: nn.Module) -> dict[str, LowRankBranch]:
    """The branches on `model`, by the name of the linear each sits beside."""
    return {name: m.lora for name, m in model.named_modules() if isinstance(m, (DenseLinear, NVFP4Linear)) and m.lora is not None}


def _matrices(adapter: AdapterFile):  # type: ignore[no-untyped-def]
    """(pair, A, B) for every pair of `adapter`, B in h3's row order; empty tensors of their shapes
    under a fake-tensor mode (nothing is read)."""
    from torch._guards import detect_fake_mode

    if detect_fake_mode() is not None:
        for pair in adapter.pairs:
            yield pair, *_empty(pair)
        return
    with adapter.open() as reader:
        for pair in adapter.pairs:
            yield (pair, *adapter.read_pair(reader, pair))


def _empty(pair: Pair) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty(pair.rank, pair.in_features), torch.empty(len(pair.keys.rows), pair.rank)
