"""h3 with LoRA adapters equals diffusers 0.42.1 with the same adapters loaded (peft), on the same
weights, through every checkpoint layout h3 reads, in both adapter formats, at scales 1.0 and 0.5
and with two adapters at once.

The base is tests/h3_reference.py's small random `MiniMaxH3Transformer3DModel` written into each
layout (the NVFP4 ones compared against diffusers on their dequantized weights, the pruned ones
against the pruned formula); the adapters are tests/lora_reference.py's: a diffusers/PEFT file saved
by diffusers (mixed ranks through its peft config), a kohya/ComfyUI file in the original names
(`diffusion_model.` prefix, `alpha` per module) that diffusers converts with its own converter, and
the PEFT file as lightx2v publishes theirs (bare diffusers names with peft's `.default.`, the alpha
in `__metadata__`).
h3 loads them with `load_transformer(path, loras=[(adapter, scale), ...])`. Bound: 1e-5 relative in
fp32, as the transformer's own reference test (measured values: `-s`, and docs/lora.md).
"""

from __future__ import annotations

import pytest
import torch

import h3_reference as ref
import lora_reference as lref
from h3core.model.checkpoint import load_transformer
from h3core.model.packing import diffusers_forward

BOUND = 1e-5
LAYOUTS = ["comfy", "comfy-prefixed", "official-shards", "diffusers-folder", "nvfp4-comfy", "nvfp4-modelopt", "pruned", "pruned-nvfp4"]
CASES = {"peft 1.0": [("peft", 1.0)], "peft 0.5": [("peft", 0.5)], "kohya 1.0": [("kohya", 1.0)], "kohya 0.5": [("kohya", 0.5)],
         "peft 0.5 + kohya 1.0": [("peft", 0.5), ("kohya", 1.0)], "lightx2v 0.5": [("lightx2v", 0.5)]}


def _base(layout: str, folder):
    """(diffusers reference model, h3 checkpoint path) for `layout`."""
    model = ref.random_model(seed=11)
    state = ref.original_state(model)
    cfg = model.config
    if layout.startswith("pruned"):
        state = ref.pruned_state(state, ref.prune(model))
    if layout.endswith(("nvfp4", "nvfp4-comfy", "nvfp4-modelopt")):
        state, dense = ref.quantize_block_linears(state, "modelopt" if layout.endswith("modelopt") else "comfy")
        ref.load_dense(model, dense)
    if layout == "official-shards":
        return model, ref.write_sharded(folder / "transformer", ref.interleave_qkv(state, cfg.num_attention_heads, cfg.attention_head_dim))
    if layout == "diffusers-folder":
        model.save_pretrained(folder / "transformer", max_shard_size="100KB")
        return model, folder / "transformer"
    prefix = "model.diffusion_model." if layout == "comfy-prefixed" else ""
    return model, ref.write_single(folder / f"{layout}.safetensors", state, prefix=prefix)


def _adapters(layout: str, folder) -> dict[str, object]:
    """The two adapter files for `layout`: on a pruned base, none targets what pruning changed except
    the kohya one's AdaLN projections, trained (as joyfox's Turbo is) on the pruned rank-8 inputs."""
    pruned = layout.startswith("pruned")
    state = ref.original_state(ref.random_model(seed=11))
    if pruned:
        state = ref.pruned_state(state, ref.prune(ref.random_model(seed=11)))
    peft = lref.peft_adapter(folder / "peft.safetensors", seed=21, targets=lref.BLOCK_TARGETS if pruned else lref.FULL_TARGETS,
                             rank=4, alpha=8.0, rank_pattern={"adaln_proj.linear": 2}, alpha_pattern={"to_out.0": 3.0})
    modules = lref.block_modules(state, adaln=True) + ([] if pruned else lref.KOHYA_STANDALONE)
    kohya = lref.kohya_adapter(folder / "kohya.safetensors", state, modules, seed=22, rank=4, ranks={"adaln_proj.linear": 2}, alpha=3.0)
    return {"peft": peft, "kohya": kohya, "lightx2v": lref.peft_dump(peft, folder / "lightx2v.safetensors", alpha=8.0)}


@pytest.fixture(scope="module", params=LAYOUTS)
def layout(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    model, path = _base(request.param, folder)
    return request.param, model, path, _adapters(request.param, folder)


@pytest.mark.parametrize("case", list(CASES))
def test_h3_with_adapters_equals_diffusers_with_them_loaded(layout, case):
    name, model, path, files = layout
    adapters = [(files[fmt], scale) for fmt, scale in CASES[case]]
    inputs = ref.packed_inputs(model)
    with torch.no_grad():
        base = model(**inputs, return_dict=False)
        expected = lref.with_adapters(model, adapters)(**inputs, return_dict=False)
        model.delete_adapters([f"a{i}" for i in range(len(adapters))])
        got = diffusers_forward(load_transformer(path, loras=adapters), **inputs)
    errors = [ref.relative_error(a, b) for a, b in zip(got, expected)]
    moved = min(ref.relative_error(a, b) for a, b in zip(expected, base))
    print(f"{name}, {case}: video {errors[0]:.2e}, audio {errors[1]:.2e} (the adapters move the output by {moved:.2f})")
    assert moved > 100 * BOUND  # the adapters change the result: the comparison can fail
    assert max(errors) <= BOUND


def test_mutation_unswapped_fc1_halves_exceed_the_bound(tmp_path):
    """diffusers' ff.net.0.proj B rows are [up; gate]: read them as h3's [gate; up] and the result moves far beyond the bound."""
    from h3core.lora import adapter as adapter_module

    model, path = _base("comfy", tmp_path)
    peft = lref.peft_adapter(tmp_path / "peft.safetensors", seed=21, targets=["ff.net.0.proj"])
    inputs = ref.packed_inputs(model)
    with torch.no_grad():
        expected = lref.with_adapters(model, [(peft, 1.0)])(**inputs, return_dict=False)
    real = adapter_module._h3_rows
    adapter_module._h3_rows = lambda up, order, head_dim: up  # every B as stored
    try:
        with torch.no_grad():
            got = diffusers_forward(load_transformer(path, loras=[(peft, 1.0)]), **inputs)
    finally:
        adapter_module._h3_rows = real
    assert min(ref.relative_error(a, b) for a, b in zip(got, expected)) > 100 * BOUND
