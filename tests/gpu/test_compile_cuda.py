"""`--compile` on CUDA (inductor's Triton kernels): the tiny preset at one GPU in bf16, compiled and
eager, one graph per block and no break, the latents within the run's derived bound, every GEMM
counted. Skipped without CUDA; `scripts/gpu_check.sh` times it at H3's widths (bench_compile.py)."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from h3core.generate.parity import latent_parity, run_tolerance
from h3core.generate.pipeline import RankPipeline, encode_prompts, new_record, rank_runtime
from h3core.generate.request import GenerateRequest, resolve
from h3core.model.compiled import CompiledBlocks
from h3core.parallel.modes import Mode
from h3core.runtime.context import RankContext

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_compiled_blocks_match_eager_on_cuda():
    ctx = RankContext(0, 1, 0, torch.device("cuda", 0), None, "none")
    run = resolve(GenerateRequest(preset="tiny", steps=3, device="cuda", dtype="bf16"))
    runtime = rank_runtime(ctx, run)
    given = encode_prompts(ctx, run, runtime, new_record(ctx))
    pipeline = RankPipeline.load(ctx, run, runtime)
    eager_record, compiled_record = new_record(ctx), new_record(ctx)
    eager = pipeline.denoise(run, given, eager_record)
    breaks = sum(counters["graph_break"].values())
    pipeline.compiled = CompiledBlocks(pipeline.model)
    compiled = pipeline.denoise(run, given, compiled_record)
    pipeline.compiled.restore()
    assert pipeline.compiled.fullgraph and sum(counters["graph_break"].values()) == breaks
    assert compiled_record.nvfp4_paths == eager_record.nvfp4_paths
    bound = run_tolerance(Mode.ULYSSES, torch.bfloat16, eager_record.nvfp4_paths)
    err = latent_parity({k.value: v.float().cpu() for k, v in compiled.items()}, {k.value: v.float().cpu() for k, v in eager.items()}, bound, "compiled cuda")
    print(f"--compile cuda bf16 vs eager: relative {err.relative:.3g} (bound {bound:g}); compile {compiled_record.compile.seconds:.1f}s")
    assert err.passed, err
