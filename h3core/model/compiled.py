"""Regional compilation (`--compile`): the repeated transformer block's forward compiled once and
run by every block (diffusers' `_repeated_blocks` idea, `compile_repeated_blocks`).

`CompiledBlocks(model)` compiles `Block.forward` (the class's function, not a block) with
`torch.compile(dynamic=False)`: one compiled function, guarded per input shape, that every one of
the model's blocks calls with itself as `self` (its weights are the graph's inputs), so a model of
50 blocks compiles what one block needs. Each block's `forward` is pointed at it; `restore()` points
them back. The model's code is not edited: the block forward stays the eager specification.

Collectives stay outside the compiled region. The parallel modes mark the code that talks to other
ranks with `outside_compiled`, which becomes `torch.compiler.disable` when compiling starts
(`h3core.model.compile_regions`; Ulysses: `UlyssesProcessor.attend_projected`, the all-to-all, the
attention between and the all-to-all back; tensor mode: the row gather before and the
reduce-scatter after attention and MLP, its hooks), and Dynamo compiles the pieces between them:

- no collective in the block (one rank): `fullgraph=True`, one graph per block forward, and any
  graph break is an error;
- Ulysses or tensor mode at more than one rank: `fullgraph=False`; the graphs end exactly at those
  regions (tests/unit/test_compiled_blocks.py and tests/dist/test_compiled_parity.py count every
  break and check its reason).

Traced functional collectives (`torch.distributed._functional_collectives`) would let one graph
span a block, but h3's collectives are ragged (per-peer split sizes), write into buffers kept by
their runtime (`Scratch`) and count their bytes (`CommStats`): tracing them would mean a second
implementation of each, while the pieces between them are where the elementwise work is.

What ran (the rank's `RankRecord`): code inside a graph counts nothing (a Python counter read in a
graph would be guarded and recompile every call), so each compiled call counts here what it ran:
every NVFP4 linear of the block once at its path, and every attention kernel once as
`<backend> (torch.compile)` unless the kernel ran outside the graph (Ulysses' exchange region
counts its own calls). fp4 GEMM shapes (`RankRecord.fp4_shapes`) run in a graph are not recorded.

Compile time is Dynamo's own account (`compile_seconds`): it is spent inside the first call of each
new shape, and the caller reports it apart from the step times.
"""

from __future__ import annotations

import functools
import os
import shutil
import warnings
from typing import Any

import torch
import torch.nn as nn

from h3core.errors import BackendUnavailable
from h3core.model.compile_regions import disable_marked
from h3core.model.attention.dispatch import AttentionKernel
from h3core.model.dit import Block, H3Model
from h3core.nvfp4.linear import NVFP4Linear

REPEATED_BLOCKS: tuple[type[nn.Module], ...] = (Block,)
"""The block classes whose forward is compiled (diffusers' `_repeated_blocks`); the token refiner's
two blocks run once per request and stay eager."""

_COMPILE_METRIC = "_compile.compile_inner"
"""Dynamo's timer around one frame's whole compilation (tracing, AOT and inductor's code)."""


CPU_COMPILERS = ("g++", "c++", "clang++")
"""What inductor builds its CPU kernels with when $CXX names none."""


def check_compile(device: str) -> None:
    """`--compile` can run on `device`: on the CPU, inductor needs a C++ compiler ($CXX, else one of
    `CPU_COMPILERS` on PATH); a GPU's kernels come from Triton, which ships with torch's CUDA builds.
    Called before any rank starts; BackendUnavailable (one line, exit 2) otherwise."""
    if device == "cuda":
        return
    named = os.environ.get("CXX")
    if (named and shutil.which(named)) or (not named and any(shutil.which(c) for c in CPU_COMPILERS)):
        return
    wanted = f"$CXX ({named}) is not a program on PATH" if named else f"no C++ compiler on PATH ({', '.join(CPU_COMPILERS)})"
    raise BackendUnavailable(f"--compile on the CPU builds its kernels with a C++ compiler: {wanted}; install one (e.g. apt-get install g++) or run without --compile")


def compile_seconds_so_far() -> float:
    """Seconds this process has spent compiling frames (Dynamo's account, every compile counted; 0
    before anything imported Dynamo: nothing has compiled)."""
    import sys

    if "torch._dynamo.utils" not in sys.modules:
        return 0.0
    from torch._dynamo.utils import compilation_time_metrics

    return float(sum(compilation_time_metrics.get(_COMPILE_METRIC, ())))


def collective_free(block: nn.Module) -> bool:
    """Whether `block` runs no collective: no parallel mode hooked its modules (tensor mode's gather
    and reduce-scatter) and its attention processor exchanges with no other rank (Ulysses at 1 rank)."""
    hooked = any(m._forward_pre_hooks or m._forward_hooks for m in block.modules())
    runtime = getattr(getattr(getattr(block, "attn", None), "processor", None), "runtime", None)
    return not hooked and (runtime is None or runtime.world_size == 1)


class BlockCounts:
    """What one compiled call of a block counts into the rank's record (module docstring): its NVFP4
    linears and attention kernels, listed once; their records are read at each call (the runtime
    attaches them)."""

    def __init__(self, linears: list[NVFP4Linear], kernels: list[AttentionKernel]):
        self.linears, self.kernels = linears, kernels

    def attention_calls(self) -> list[int]:
        """Each kernel's count so far (what a kernel run outside the graph adds to)."""
        return [sum(k.record.values()) if k.record is not None else 0 for k in self.kernels]

    def add_call(self, before: list[int]) -> None:
        for linear in self.linears:
            if linear.record is not None:
                linear.record[linear.path] += 1
        for kernel, counted in zip(self.kernels, before):
            if kernel.record is not None and sum(kernel.record.values()) == counted:  # not counted outside the graph
                kernel.record[f"{kernel.backend} (torch.compile)"] += 1


class CompiledBlocks:
    """`model`'s repeated blocks running one compiled forward (module docstring). Owns the compiled
    function, the compile time spent in it and the count of compiled block calls. `backend`:
    torch.compile's (inductor: generated kernels; the tests' `aot_eager` checks the cut without them)."""

    def __init__(self, model: H3Model, backend: str = "inductor"):
        disable_marked()  # the modes' collectives out of every graph (h3core.model.compile_regions)
        self.blocks = [m for m in model.modules() if type(m) in REPEATED_BLOCKS]
        self.fullgraph = all(collective_free(b) for b in self.blocks)
        self.function = torch.compile(Block.forward, fullgraph=self.fullgraph, dynamic=False, backend=backend)
        self.compile_seconds = 0.0
        self.calls = 0
        for block in self.blocks:
            counted = BlockCounts([m for m in block.modules() if isinstance(m, NVFP4Linear)], [m for m in block.modules() if isinstance(m, AttentionKernel)])
            block.forward = functools.partial(self._run, block, counted)  # an instance attribute: nn.Module.__call__ takes it

    def _run(self, block: Block, counts: "BlockCounts", *args: Any) -> torch.Tensor:
        before = counts.attention_calls()
        started = compile_seconds_so_far()
        with warnings.catch_warnings():  # read once per process: H3_EMULATE_FP4's cached parse, constant in the graph
            warnings.filterwarnings("ignore", message="Dynamo detected a call to a `functools.lru_cache`")
            out = self._call(block, args)
        self.compile_seconds += compile_seconds_so_far() - started
        self.calls += 1
        counts.add_call(before)
        return out

    def _call(self, block: Block, args: tuple) -> torch.Tensor:
        try:
            return self.function(block, *args)
        except torch._dynamo.exc.TorchDynamoException as err:  # a graph break under fullgraph, or the backend's build failed
            reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise BackendUnavailable(f"--compile could not compile the transformer block here ({reason}); run without --compile (H3_DEBUG=1: the whole trace)") from err

    def restore(self) -> None:
        """Every block back on its eager forward (the compiled code stays in Dynamo's cache)."""
        for block in self.blocks:
            del block.forward
