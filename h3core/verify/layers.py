"""Checks of distributed layers against the same layer on one rank, on the spec's synthetic model:

- `sdpa`: Ulysses' exchange of finished q, k, v around the model's `AttentionKernel`
  (`UlyssesProcessor.attend`) vs `attend` on every token;
- `projection`: the `FinalLayer` on each rank's rows, gathered per latent kind, vs the whole sequence;
- `tp`: every block's attention and MLP sharded by `parallelize` in tensor mode (NVFP4 shards cut
  by `ModelWeights` for the plan's ranges, ragged heads and NVFP4 blocks, gather and reduce-scatter
  hooks) vs the unsharded block.

Tolerances are `h3core.generate.parity.layer_tolerance` (one layer: one rounding source, nothing to amplify
it): Ulysses-style checks (rows multiplied apart) get the Ulysses bound, tensor parallelism
(partials summed in another order than one GEMM) the tensor bound.
"""

from __future__ import annotations

import torch

from h3core.generate.parity import layer_tolerance
from h3core.model.attention import AttentionKernel, attend
from h3core.model.dit import Clocks, PackedSequence, rope_table
from h3core.model.positions import position_ids
from h3core.parallel import collectives
from h3core.parallel.parallelize import left_out_at_load, parallelize
from h3core.parallel.partition import clip_segments, kind_spans
from h3core.parallel.modes import Mode
from h3core.parallel.runtime import ParallelRuntime
from h3core.parallel.modes.tensor import ModelWeights
from h3core.parallel.modes.ulysses import UlyssesProcessor
from h3core.runtime.context import RankContext
from h3core.runtime.device import Stopwatch
from h3core.verify.compare import load_model, measure, measure_all, seeded, spec_dtype
from h3core.verify.rows import Measure
from h3core.verify.spec import VerifySpec

SDPA_VARIANTS = ("ulysses",)
PROJECTION_VARIANTS = ("final layer",)
TP_VARIANTS = ("attention", "mlp")


def measure_sdpa(ctx: RankContext, spec: VerifySpec) -> list[Measure]:
    """Ulysses attention (seq->head, SDPA on this rank's heads, head->seq) vs SDPA on everything."""
    cfg, dtype = spec.config, spec_dtype(spec)
    plan = spec.plan(ctx.world_size, Mode.ULYSSES)
    rows = plan.sequences[0].tokens[ctx.rank]
    runtime = ParallelRuntime(plan, ctx.rank, ctx.group)
    attention = UlyssesProcessor(AttentionKernel("sdpa"), runtime)
    shape = (spec.num_tokens, cfg.num_heads, cfg.head_dim)
    with Stopwatch(ctx.device) as watch, torch.inference_mode():
        q, k, v = (seeded(shape, spec.seed + i, dtype, ctx.device) for i in (1, 2, 3))  # [S, H, Dh] each
        tokens = plan.sequences[0].tokens
        out = attention.attend(q[rows.start : rows.stop], k[rows.start : rows.stop], v[rows.start : rows.stop], tokens)  # [S_loc, H, Dh]
        reference = attend(q, k, v, "sdpa")[rows.start : rows.stop]
        result = measure(SDPA_VARIANTS[0], out, reference, layer_tolerance(Mode.ULYSSES, dtype))
    return [result.model_copy(update={"seconds": watch.seconds})]


def measure_projection(ctx: RankContext, spec: VerifySpec) -> list[Measure]:
    """The final layer on this rank's rows, gathered per latent kind, vs the final layer on all rows."""
    cfg, dtype, segments = spec.config, spec_dtype(spec), spec.segments
    tokens = spec.plan(ctx.world_size, Mode.ULYSSES).sequences[0].tokens
    rows = tokens[ctx.rank]
    model = load_model(spec, ctx.device)
    with Stopwatch(ctx.device) as watch, torch.inference_mode():
        x = seeded((spec.num_tokens, cfg.hidden), spec.seed + 20, dtype, ctx.device)  # [S, D] the last block's output
        clocks = Clocks.of({"video": 0.6, "audio": 0.35}).to(ctx.device)
        cond = model.conditioning(clocks.values)
        rope = rope_table(cfg, position_ids(segments, spec.shape)).to(ctx.device)
        mine = PackedSequence(segments=clip_segments(segments, rows), features={}, rope=rope.select(rows))
        local = model.final_layer(x[rows.start : rows.stop], cond, mine, clocks)  # {kind: [n_loc, P]}
        reference = model.final_layer(x, cond, PackedSequence(segments=segments, features={}, rope=rope), clocks)  # {kind: [n, P]}
        pairs = []
        for kind, expected in reference.items():
            mine = local.get(kind, expected.new_empty(0, expected.shape[1]))  # a rank may hold none of a kind
            gathered = collectives.gather_rows(mine, kind_spans(segments, tokens, kind), ctx.group)  # [n, P]
            pairs.append((kind.value, gathered, expected))
        result = measure_all(PROJECTION_VARIANTS[0], pairs, layer_tolerance(Mode.ULYSSES, dtype))
    return [result.model_copy(update={"seconds": watch.seconds})]


def measure_tp(ctx: RankContext, spec: VerifySpec) -> list[Measure]:
    """Every block's attention and MLP in tensor mode (`parallelize`) vs the unsharded block."""
    cfg, dtype, segments = spec.config, spec_dtype(spec), spec.segments
    plan = spec.plan(ctx.world_size, Mode.TENSOR)
    sequence = plan.sequences[0]
    rows = sequence.tokens[ctx.rank]
    full = load_model(spec, ctx.device)
    sharded = load_model(spec, ctx.device, skip=left_out_at_load(plan, cfg.num_blocks))  # block linears come as shards
    runtime = ParallelRuntime(plan, ctx.rank, ctx.group)
    parallelize(sharded, runtime, ModelWeights(full))
    rope = rope_table(cfg, position_ids(segments, spec.shape)).to(ctx.device)
    measures = []
    with torch.inference_mode():
        h = seeded((spec.num_tokens, cfg.hidden), spec.seed + 30, dtype, ctx.device)  # [S, D] modulated input
        layers = {
            "attention": lambda block, x, r: block.attn(x, rope.select(r)),
            "mlp": lambda block, x, r: block.mlp(x),
        }
        for variant, forward in layers.items():
            with Stopwatch(ctx.device) as watch:
                pairs = []
                for index, (one, shard) in enumerate(zip(full.blocks, sharded.blocks)):
                    runtime.enter_forward(rows, sequence.num_tokens)  # what the model's outermost hook does
                    out = forward(shard, h[rows.start : rows.stop], rows)  # [S_loc, D]
                    runtime.leave_forward()
                    expected = forward(one, h, rope.rows)[rows.start : rows.stop]
                    pairs.append((f"block {index}", out, expected))
                result = measure_all(variant, pairs, layer_tolerance(Mode.TENSOR, dtype))
            measures.append(result.model_copy(update={"seconds": watch.seconds}))
    return measures
