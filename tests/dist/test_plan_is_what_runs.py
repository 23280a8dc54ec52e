"""The plan is what runs: `h3 plan` prints the plan `resolve` builds once and every rank consumes, and
each rank's record of the spans and shards it used is its share of that plan.

On the shared World: tensor mode on 6 of its ranks (a sub-group: the runtime takes its group from the
run, not the world) with the narrow preset (56 heads over 6: 10,10,9,9,9,9; 74 FC2 blocks), and
guidance whose negative prompt is another length, so the latent rows are re-split between the two
sequences' partitions every step (repartition_rows). The report is built and compared with one
rank as `h3 generate --parity` does it.
"""

from __future__ import annotations

import pytest
import torch

from h3core.generate.parity import tolerance
from h3core.generate.pipeline import rank_generate
from h3core.generate.report import RunReport, build_report
from h3core.generate.request import GenerateRequest, resolve
from h3core.generate.run import reference_parity
from h3core.model.sequence import SegmentKind
from h3core.parallel.modes import Mode
from h3core.parallel.plan import ParallelPlan

from commands import run_main

SIX = dict(mode=Mode.TENSOR, world_size=6, preset="narrow", steps=2, guidance_scale=3.0, negative_prompt="blurry", device="cpu")


def _generate_on_first_ranks(ctx, count, run):
    """World task: `rank_generate` on ranks 0..count-1; every one of them returns its outcome."""
    sub = ctx.first_ranks(count)
    return None if sub is None else rank_generate(sub, run)


@pytest.fixture(scope="module")
def six(world8):
    run = resolve(GenerateRequest(**SIX))
    outcomes = world8.run(_generate_on_first_ranks, 6, run)[:6]
    report = build_report(run, outcomes)
    report.parity = reference_parity(run, outcomes[0])
    return report


def test_tensor_mode_on_six_ranks_with_ragged_heads_matches_one_rank(six):
    report = RunReport.model_validate_json(six.model_dump_json())  # as report.json holds it
    assert report.partition.heads == [10, 10, 9, 9, 9, 9]
    assert report.ranks_on == "6 CPU ranks (Gloo)"
    assert report.parity.passed and report.parity.tolerance == tolerance(Mode.TENSOR, torch.float32)
    for rank in report.ranks:  # what every rank really ran in the loop: fused attention, the CPU's NVFP4 path
        assert rank.attention_kernels.keys() == {"sdpa:flash_attention"} and rank.nvfp4_paths.keys() == {"cpu-dequant"}
    assert (report.attention_kernel, report.nvfp4_path) == ("sdpa:flash_attention", "cpu-dequant")
    assert report.comm_total.kinds["repartition_rows"].calls > 0
    full = report.ranks[0].weights.block_linears_full
    # No rank holds more than its partition share (heads for qkv/out, NVFP4 blocks for fc1/fc2), and
    # together they hold the block linears once. What a rank reads of the Comfy file is its share plus
    # at most the scale tiles its ranges cut: the 128 x 4 tiles are the smallest unit of a swizzled
    # scale tensor a range of rows or columns can be read in (an edge tile at each end of each of the
    # 5 row ranges of qkv and fc1, two edge column tiles per 128-row tile of out_proj and fc2).
    cfg = resolve(GenerateRequest(**SIX)).config
    tile_row_bytes = 128 * -(-cfg.hidden // 16 // 4) * 4
    slack = cfg.num_blocks * (5 * 2 * tile_row_bytes + 2 * 2 * 512 * -(-cfg.hidden // 128))
    fc_blocks = [c.scale_columns.stop - c.scale_columns.start for c in (r.tensor.fc2_columns for r in report.partition.ranks)]
    # On the CPU `--decoded-weights auto` also holds each rank's shards decoded (the plan's bytes,
    # counted in what the linears hold): the packed share is what is left.
    decoded = report.partition.decoded
    held = decoded.bytes_per_rank if decoded is not None and decoded.held else [0] * len(report.ranks)
    packed = [r.weights.block_linears_resident - extra for r, extra in zip(report.ranks, held)]
    for rank, resident, heads, blocks in zip(report.ranks, packed, report.partition.heads, fc_blocks):
        share = max(heads / 56, blocks / sum(fc_blocks))
        assert resident <= 1.05 * share * full
        assert rank.weights.block_linears_read <= 1.05 * share * full + slack
    assert sum(packed) <= 1.02 * full


def test_what_h3_plan_prints_is_what_the_ranks_ran(six, capsys):
    plan = six.partition
    prompt_tokens = sum(len(s) for s in plan.segments if s.kind is SegmentKind.TEXT)
    code, out, err = run_main(capsys, "plan", "6", "--mode", "tensor", "--preset", "narrow", "--text-tokens", str(prompt_tokens), "--json")
    assert code == 0, err
    printed = ParallelPlan.model_validate_json(out)
    # `h3 plan` plans the prompt's sequence only (so its layout's one group runs the prompt alone)
    # (the decoded-weights choice depends on the GPU a run finds: `h3 plan --memory` makes it, plain `h3 plan` does not)
    assert printed == plan.model_copy(update={"sequences": plan.sequences[:1], "layout": plan.layout.model_copy(update={"guided": False}), "decoded": None})
    assert [g.ranks for g in plan.layout.groups] == [list(range(6))] and plan.layout.groups[0].runs == ["prompt", "negative prompt"]
    assert [s.name for s in plan.sequences] == ["prompt", "negative prompt"] and plan.sequences[0].tokens != plan.sequences[1].tokens
    for rank in six.ranks:  # recorded where each was used: the QKV shard's heads, the rows fed to the model, the shards read
        mine = plan.ranks[rank.rank]
        assert rank.used.heads == mine.heads and rank.used.shards == mine.tensor
        assert rank.used.tokens == {seq.name: seq.tokens[rank.rank] for seq in plan.sequences}
