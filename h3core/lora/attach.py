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
from contextlib import ExitStack
from typing import Sequence

import torch
from torch import nn

from h3core.files.safetensors import SafetensorsReader
from h3core.lora.adapter import AdapterFile, Pair
from h3core.lora.branch import LowRankBranch, stack_pairs
from h3core.lora.tensor import cut_for
from h3core.nvfp4.linear import DenseLinear, NVFP4Linear


def attach_adapters(model: nn.Module, adapters: Sequence[tuple[AdapterFile, float]], dtype: torch.dtype) -> int:
    """Every adapter's branches on `model` (replacing any already there), each pair scaled by its
    adapter's user scale; NVFP4 linears' branches in `dtype`, dense ones' in their weight's dtype.
    One linear at a time: only its pairs are in host memory at once. Returns the bytes the branches
    hold on this rank."""
    detach_adapters(model)
    by_target: dict[str, list[tuple[int, Pair, float]]] = defaultdict(list)
    for index, (adapter, scale) in enumerate(adapters):
        for pair in adapter.pairs:
            by_target[pair.target].append((index, pair, scale * pair.scale))
    held = 0
    with ExitStack() as stack:
        readers = [_reader(adapter, stack) for adapter, _ in adapters]
        for target, entries in sorted(by_target.items()):
            linear = model.get_submodule(target)
            assert isinstance(linear, (DenseLinear, NVFP4Linear)), f"{target} is {type(linear).__name__}, not a linear"
            pairs = [(*_matrices(adapters[i][0], readers[i], pair), pair.keys.rows, scale) for i, pair, scale in entries]
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


def _reader(adapter: AdapterFile, stack: ExitStack) -> SafetensorsReader | None:
    """The adapter's file open for reading, or None under a fake-tensor mode (the dry run reads nothing)."""
    from torch._guards import detect_fake_mode

    return None if detect_fake_mode() is not None else stack.enter_context(adapter.open())


def _matrices(adapter: AdapterFile, reader: SafetensorsReader | None, pair: Pair) -> tuple[torch.Tensor, torch.Tensor]:
    """(A, B) of `pair`, B in h3's row order; empty tensors of their shapes without a reader (fake mode)."""
    if reader is None:
        return torch.empty(pair.rank, pair.in_features), torch.empty(len(pair.keys.rows), pair.rank)
    return adapter.read_pair(reader, pair)
