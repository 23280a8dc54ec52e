"""`--compile` at one rank (h3core.model.compiled): the repeated block compiles as ONE graph with no
break (`fullgraph=True`), every block runs that one compile, the compiled run is the eager run
within the derived bound (inductor's generated kernels), the rank's record counts what ran, and the
step cache (which runs block 0 and blocks 1.. apart) takes the same decisions compiled.

Inductor's C++ build of one tiny block is the slow part (tens of seconds on a loaded 2-core
machine; the kernels are cached on disk for later runs): one `CompiledBlocks` serves the module."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from h3core.generate.parity import latent_parity, layer_tolerance, tolerance
from h3core.generate.pipeline import RankPipeline, encode_prompts, new_record, rank_runtime
from h3core.generate.request import GenerateRequest, resolve
from h3core.model.compiled import CompiledBlocks, collective_free
from h3core.model.dit import Block
from h3core.parallel.modes import Mode
from h3core.runtime.context import RankContext

ONE_RANK = Mode.ULYSSES  # the bound of a one-rank run (both modes derive 8 eps per linear)


def _loaded(steps: int, cache: str = "off"):
    ctx = RankContext(0, 1, 0, torch.device("cpu"), None, "none")
    run = resolve(GenerateRequest(preset="tiny", steps=steps, cache=cache))
    runtime = rank_runtime(ctx, run)
    return ctx, run, encode_prompts(ctx, run, runtime, new_record(ctx)), RankPipeline.load(ctx, run, runtime)


def _denoise(ctx, run, given, pipeline):
    record = new_record(ctx)
    whole = pipeline.denoise(run, given, record)
    return whole, record


@pytest.fixture(scope="module")
def one_forward():
    """A tiny one-rank pipeline, its eager run of one forward, the first block's inputs of it, then
    the same pipeline compiled (inductor) and run again."""
    ctx, run, given, pipeline = _loaded(steps=2)
    seen = []
    hook = pipeline.model.blocks[0].register_forward_pre_hook(lambda module, args: seen.append(tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)))
    eager = _denoise(ctx, run, given, pipeline)
    hook.remove()
    torch._dynamo.reset()  # an earlier test of this process (tests/cli) may have compiled this very shape: compile it here
    graphs, breaks = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
    pipeline.compiled = CompiledBlocks(pipeline.model)
    compiled = _denoise(ctx, run, given, pipeline)
    cut = {"graphs": counters["stats"]["unique_graphs"] - graphs, "breaks": sum(counters["graph_break"].values()) - breaks}
    yield {"pipeline": pipeline, "eager": eager, "compiled": compiled, "inputs": seen[0], "cut": cut}
    pipeline.compiled.restore()


def test_both_blocks_ran_one_graph_without_a_break(one_forward):
    """One forward at one shape: one graph for the two blocks (the second reuses the first's compile)
    and no graph break (`fullgraph=True` would have raised on one; the counter says none was met)."""
    pipeline = one_forward["pipeline"]
    assert all(collective_free(block) for block in pipeline.model.blocks) and pipeline.compiled.fullgraph
    assert one_forward["cut"] == {"graphs": 1, "breaks": 0}
    assert pipeline.compiled.calls == len(pipeline.model.blocks)


def test_compiled_run_is_eager_within_the_bound_and_counts_the_same(one_forward):
    (eager, eager_record), (compiled, compiled_record) = one_forward["eager"], one_forward["compiled"]
    bound = tolerance(ONE_RANK, torch.float32)
    err = latent_parity({k.value: v for k, v in compiled.items()}, {k.value: v for k, v in eager.items()}, bound, "compiled x1")
    print(f"--compile (inductor) x1 vs eager: relative {err.relative:.3g} (bound {bound:g}); compile {compiled_record.compile.seconds:.1f}s")
    assert err.passed, err
    assert compiled_record.nvfp4_paths == eager_record.nvfp4_paths  # every GEMM counted once
    assert compiled_record.attention_kernels == {"sdpa (torch.compile)": sum(eager_record.attention_kernels.values())}
    assert eager_record.compile is None
    record = compiled_record.compile
    assert record.fullgraph and record.seconds > 0 and record.step_compile_seconds[0] == record.seconds
    assert record.step_seconds[0] == pytest.approx(compiled_record.step_seconds[0] - record.seconds, abs=1e-9)


def test_one_block_within_the_layer_bound_and_every_block_reuses_the_compile(one_forward):
    pipeline, (x, *rest) = one_forward["pipeline"], one_forward["inputs"]
    compiled = pipeline.compiled
    graphs, seconds = counters["stats"]["unique_graphs"], compiled.compile_seconds
    with torch.inference_mode():
        outs = [block(x.clone(), *rest) for block in pipeline.model.blocks]
        eager = Block.forward(pipeline.model.blocks[0], x.clone(), *rest)
    assert (counters["stats"]["unique_graphs"], compiled.compile_seconds) == (graphs, seconds)  # nothing compiled anew
    relative = ((outs[0] - eager).abs().max() / eager.abs().max()).item()
    print(f"one compiled block vs eager: relative {relative:.3g} ({relative / torch.finfo(torch.float32).eps:.1f} eps)")
    assert relative <= layer_tolerance(ONE_RANK, torch.float32)
    assert not torch.equal(outs[0], outs[1])  # each block ran its own weights through the shared compile


def test_step_cache_takes_the_same_steps_compiled():
    """The cache runs block 0 and blocks 1.. as two calls (`run_blocks`): both go through the compiled
    forward. `aot_eager`: the cut and the decisions, without a second inductor build."""
    ctx, run, given, pipeline = _loaded(steps=5, cache="fbcache:0.4")
    eager, eager_record = _denoise(ctx, run, given, pipeline)
    pipeline.compiled = CompiledBlocks(pipeline.model, backend="aot_eager")
    compiled, compiled_record = _denoise(ctx, run, given, pipeline)
    pipeline.compiled.restore()
    skipped = eager_record.cache.sequences["prompt"].skipped
    assert 0 < len(skipped) < 4 and compiled_record.cache.sequences["prompt"].skipped == skipped
    assert compiled_record.nvfp4_paths == eager_record.nvfp4_paths  # the skipped blocks counted nothing either way
    assert all(torch.equal(compiled[k], eager[k]) for k in eager)  # aot_eager: the same ops, the same bits


def test_restore_puts_every_block_back_on_its_eager_forward():
    *_, pipeline = _loaded(steps=2)
    compiled = CompiledBlocks(pipeline.model, backend="eager")
    assert all("forward" in vars(block) for block in pipeline.model.blocks)
    compiled.restore()
    assert not any("forward" in vars(block) for block in pipeline.model.blocks)
