"""Both modes on checkpoints stored otherwise than h3's synthetic file: the official shards (bf16-style
dense linears, qkv per-head interleaved) and the diffusers `transformer/` folder (to_q/to_k/to_v,
fc1 as [up; gate]). Tensor mode reads each rank's heads and fc ranges through the layout's row maps
(a head's q, k and v rows are three separate runs of the interleaved tensor); Ulysses loads every
weight. Each run's latents against one rank of the same checkpoint, within the derived bound
(Ulysses bitwise), and one rank against the Comfy single file of the same weights, bitwise."""

from __future__ import annotations

import pytest
import torch

import h3_reference as ref
from h3core.generate.parity import latent_parity, tolerance
from h3core.generate.pipeline import rank_generate
from h3core.generate.request import GenerateRequest, resolve
from h3core.parallel.modes import Mode
from h3core.verify.session import as_world_of_one


def _generate(ctx, count, run):
    sub = ctx.first_ranks(count) if count > 1 else (as_world_of_one(ctx) if ctx.rank == 0 else None)
    if sub is None:
        return None
    outcome = rank_generate(sub, run)
    return {"latents": outcome.latents if sub.rank == 0 else None, "read": outcome.weights.block_linears_read}


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    """The same small random model written as a Comfy file, the official shards and a diffusers folder."""
    folder = tmp_path_factory.mktemp("layouts")
    model = ref.random_model(seed=31)
    state = ref.original_state(model)
    cfg = model.config
    model.save_pretrained(folder / "diffusers" / "transformer", max_shard_size="100KB")
    return {
        "comfy": ref.write_single(folder / "comfy.safetensors", state),
        "official": ref.write_sharded(folder / "official" / "transformer", ref.interleave_qkv(state, cfg.num_attention_heads, cfg.attention_head_dim)),
        "diffusers": folder / "diffusers" / "transformer",
    }


def _run(path, mode, count):
    return resolve(GenerateRequest(model_path=path, preset="tiny", mode=mode, world_size=count, steps=3, device="cpu"))


@pytest.mark.parametrize("layout", ["official", "diffusers"])
@pytest.mark.parametrize("mode", list(Mode))
def test_both_modes_on_other_layouts_match_one_rank(world8, layouts, layout, mode):
    reference = world8.run(_generate, 1, _run(layouts["comfy"], Mode.ULYSSES, 1))[0]["latents"]
    one = world8.run(_generate, 1, _run(layouts[layout], Mode.ULYSSES, 1))[0]
    assert latent_parity(one["latents"], reference, 0.0, "comfy").bitwise  # the layouts hold the same weights
    for count in (2, 4):
        results = world8.run(_generate, count, _run(layouts[layout], mode, count))[:count]
        parity = latent_parity(results[0]["latents"], reference, tolerance(mode, torch.float32), "1 rank")
        print(f"{layout}, {mode.value} x{count}: relative {parity.relative:.3g} (bound {parity.tolerance:.3g})")
        assert parity.passed and (parity.bitwise or mode == Mode.TENSOR), parity
        if mode == Mode.TENSOR:  # each rank read its share of the block linears, not the whole
            assert all(r["read"] <= one["read"] / count * 1.05 for r in results), [r["read"] for r in results]
