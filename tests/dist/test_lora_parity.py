"""LoRA adapters give the one-rank result at every world size, in both modes: Gloo ranks run the
whole pipeline with two adapters at once (a kohya/ComfyUI one and a diffusers/PEFT one, whose qkv
pairs each have their own A) at 2, 4, 6 and 8 ranks against one rank, within the derived bound
(`h3core.generate.parity.tolerance`). In tensor mode every branch is cut as its linear is (qkv rows
by head inside each of q, k and v; fc1 rows in both halves; out_proj and fc2 by input columns, the
partial joining the linear's reduce-scatter); the tiny preset's shards are ragged at 6 ranks. Also on
the fp4 path (CPU emulation), where the branch's `A x` travels with the gathered codes. A mutation
that cuts B's rows in the wrong order moves the latents far beyond the bound. Errors: `-s`."""

from __future__ import annotations

import pytest
import torch

from h3core.generate.parity import latent_parity, tolerance
from h3core.generate.pipeline import rank_generate
from h3core.generate.request import GenerateRequest, resolve
from h3core.lora.spec import LoraSpec
from h3core.lora.synthetic import write_synthetic_adapter
from h3core.model.config import preset
from h3core.parallel.modes import Mode
from h3core.verify.session import as_world_of_one

COUNTS = [2, 4, 6, 8]
BASE = dict(preset="tiny", steps=3)


def _generate(ctx, count, run, fp4=False, wrong_cut=False):
    """World task: the pipeline on ranks 0..count-1 (fp4 emulation on with `fp4`; with `wrong_cut` a
    column-parallel branch's B rows cut in reversed span order); rank 0 returns its latents and the
    branch bytes every rank held."""
    from h3core.lora import tensor as lora_tensor
    from h3core.nvfp4.linear import NVFP4Linear

    sub = ctx.first_ranks(count) if count > 1 else (as_world_of_one(ctx) if ctx.rank == 0 else None)
    if sub is None:
        return None
    real = lora_tensor.split_branch_for_tensor
    if wrong_cut:
        def wrong(branch, split, part):  # noqa: ANN001, ANN202
            return branch.rows_cut(list(reversed(part))) if split.value == "column" else real(branch, split, part)
        lora_tensor.split_branch_for_tensor = wrong
    NVFP4Linear.emulate_fp4 = True if fp4 else None
    try:
        outcome = rank_generate(sub, run)
    finally:
        NVFP4Linear.emulate_fp4 = None
        lora_tensor.split_branch_for_tensor = real
    return {"latents": outcome.latents if sub.rank == 0 else None, "adapter_bytes": outcome.adapter_bytes, "paths": outcome.nvfp4_paths}


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lora")
    config = preset("tiny")
    kohya = write_synthetic_adapter(folder / "kohya.safetensors", config, rank=8, seed=1, fmt="kohya", alpha=4.0, std=0.05)
    peft = write_synthetic_adapter(folder / "peft.safetensors", config, rank=4, seed=2, fmt="peft", std=0.05)
    return (LoraSpec(path=kohya), LoraSpec(path=peft, scale=0.5))


def _run(adapters, mode, count):
    return resolve(GenerateRequest(**BASE, mode=mode, world_size=count, loras=adapters))


@pytest.fixture(scope="module")
def references(world8, adapters):
    """One rank (the identity path, both modes alike), without and with the fp4 emulation; and without adapters."""
    one = _run(adapters, Mode.ULYSSES, 1)
    plain = resolve(GenerateRequest(**BASE))
    return {"dequant": world8.run(_generate, 1, one)[0], "fp4": world8.run(_generate, 1, one, True)[0],
            "base": world8.run(_generate, 1, plain)[0]}


@pytest.mark.parametrize("mode", list(Mode))
def test_adapters_match_one_rank_at_every_count(world8, adapters, references, mode):
    reference = references["dequant"]
    moved = latent_parity(reference["latents"], references["base"]["latents"], 0.0, "no adapters").relative
    assert moved > 1e-3  # the adapters change the result
    bound = tolerance(mode, torch.float32)
    for count in COUNTS:
        run = _run(adapters, mode, count)
        results = world8.run(_generate, count, run)[:count]
        parity = latent_parity(results[0]["latents"], reference["latents"], bound, "1 rank")
        print(f"LoRA, {mode.value} x{count}: relative {parity.relative:.3g} (bound {bound:.3g}; adapters move the latents by {moved:.3g})")
        assert parity.passed, parity
        assert [r["adapter_bytes"] for r in results] == [sum(a.bytes_per_rank[i] for a in run.adapters) for i in range(count)]


def test_tensor_mode_on_the_fp4_path_gathers_the_branch_input_with_the_codes(world8, adapters, references):
    reference = references["fp4"]
    assert set(reference["paths"]) == {"cpu-fp4-emulated"}
    bound = tolerance(Mode.TENSOR, torch.float32)
    for count in COUNTS:
        results = world8.run(_generate, count, _run(adapters, Mode.TENSOR, count), True)[:count]
        parity = latent_parity(results[0]["latents"], reference["latents"], bound, "1 rank")
        print(f"LoRA, tensor x{count}, fp4 emulated: relative {parity.relative:.3g} (bound {bound:.3g})")
        assert parity.passed, parity


@pytest.mark.parametrize("count", [2, 6])
def test_mutation_a_wrongly_cut_b_exceeds_the_bound(world8, adapters, references, count):
    result = world8.run(_generate, count, _run(adapters, Mode.TENSOR, count), False, True)[0]
    parity = latent_parity(result["latents"], references["dequant"]["latents"], tolerance(Mode.TENSOR, torch.float32), "1 rank")
    print(f"LoRA, tensor x{count}, B rows cut in the wrong order: relative {parity.relative:.3g} (bound {parity.tolerance:.3g})")
    assert parity.relative > 100 * parity.tolerance
