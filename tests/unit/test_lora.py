"""LoRA adapters: formats detected from the keys, every bad input one line, the base weights byte for
byte untouched, a branch cut exactly as its linear, and the schedule an adapter's metadata asks for."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import h3_reference as ref
import lora_reference as lref
from h3core.errors import AdapterError
from h3core.generate.request import GenerateRequest, RunShape, resolve
from h3core.lora.adapter import open_adapter
from h3core.lora.attach import attach_adapters, branches, detach_adapters
from h3core.lora.branch import LowRankBranch, UpBlock
from h3core.lora.keys import Format
from h3core.lora.spec import LoraSpec, lora_spec, parse_lora
from h3core.lora.synthetic import write_synthetic_adapter
from h3core.model.checkpoint import Checkpoint, load_transformer
from h3core.model.config import preset
from h3core.model.packing import diffusers_forward
from h3core.span import Span


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """(folder, the small model's original state, a Comfy NVFP4 checkpoint of it, its config)."""
    folder = tmp_path_factory.mktemp("lora")
    state = ref.original_state(ref.random_model(seed=3))
    stored, _ = ref.quantize_block_linears(state, "comfy")
    path = ref.write_single(folder / "nvfp4.safetensors", stored)
    return folder, state, path, Checkpoint.open(path, preset("h3")).config


def _kohya(base, name="k.safetensors", **kwargs) -> Path:
    folder, state, _, _ = base
    return lref.kohya_adapter(folder / name, state, lref.block_modules(state), seed=kwargs.pop("seed", 5), **kwargs)


def _rewrite(src: Path, dst: Path, edit) -> Path:
    """A copy of adapter `src` with its tensors passed through `edit(dict) -> dict` (metadata kept)."""
    from h3core.files.safetensors import read_header

    _, _, metadata = read_header(src)
    save_file(edit(load_file(str(src))), str(dst), metadata=metadata)
    return dst


# --- formats ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("prefix, flat", [("diffusion_model.", False), ("", False), ("model.diffusion_model.", False), ("", True)])
def test_kohya_names_under_every_prefix_are_one_adapter(base, prefix, flat):
    _, _, path, config = base
    adapter = open_adapter(_kohya(base, f"k{len(prefix)}{flat}.safetensors", prefix=prefix, flat=flat), config)
    assert adapter.format is Format.KOHYA and len(adapter.targets) == 4 * (2 + 2)  # 2 blocks + 2 refiner blocks, 4 linears each
    assert adapter.targets == sorted({p.target for p in adapter.pairs})


def test_peft_files_map_q_k_v_onto_thirds_of_the_fused_qkv(base):
    folder, _, _, config = base
    adapter = open_adapter(lref.peft_adapter(folder / "p.safetensors", seed=1, targets=lref.BLOCK_TARGETS), config)
    thirds = sorted((p.keys.rows.start, p.keys.rows.stop) for p in adapter.pairs if p.target == "blocks.0.attn.qkv_proj")
    width = config.attention_width
    assert adapter.format is Format.PEFT and thirds == [(0, width), (width, 2 * width), (2 * width, 3 * width)]


def test_diffsynth_per_head_interleaved_qkv_gives_the_stacked_result(base):
    """DiffSynth-Studio trains on the official shards' per-head [q_h; k_h; v_h] rows and writes peft's
    `.default.` over the original names: h3 stacks B's rows back; the result is the kohya file's."""
    folder, state, path, config = base
    kohya = _kohya(base, "plain.safetensors", alpha=None)

    def to_diffsynth(tensors):
        out = {}
        for key, value in tensors.items():
            module = key.removeprefix("diffusion_model.").rsplit(".", 2)[0]
            if key.endswith("lora_up.weight") and module.endswith("qkv_proj"):
                value = value.view(3, config.num_heads, config.head_dim, -1).transpose(0, 1).reshape(value.shape)
            out[f"{module}.{'lora_A' if 'down' in key else 'lora_B'}.default.weight"] = value
        return out

    diffsynth = _rewrite(kohya, folder / "diffsynth.safetensors", to_diffsynth)
    assert open_adapter(diffsynth, config).format is Format.ORIGINAL_PEFT
    inputs = ref.packed_inputs(ref.random_model(seed=3))
    with torch.no_grad():
        a, b = diffusers_forward(load_transformer(path, loras=[kohya]), **inputs), diffusers_forward(load_transformer(path, loras=[diffsynth]), **inputs)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_a_folder_of_diffusers_save_lora_weights_is_its_file(base):
    folder, _, _, config = base
    sub = folder / "saved"
    sub.mkdir()
    lref.peft_adapter(sub / "pytorch_lora_weights.safetensors", seed=1, targets=["to_q"])
    assert open_adapter(sub, config).path.name == "pytorch_lora_weights.safetensors"


# --- bad input: one line each ----------------------------------------------------------------------------


def _refused(path, config, needle):
    with pytest.raises(AdapterError) as err:
        open_adapter(path, config)
    message = str(err.value)
    assert "\n" not in message and needle in message, message
    return message


def test_an_adapter_for_another_model_names_a_few_keys(base):
    folder, _, _, config = base
    path = folder / "sdxl.safetensors"
    save_file({"lora_unet_down_blocks_0_attentions_0_proj_in.lora_down.weight": torch.zeros(4, 8),
               "lora_unet_down_blocks_0_attentions_0_proj_in.lora_up.weight": torch.zeros(8, 4)}, str(path))
    _refused(path, config, "no key names a linear of the MiniMax-H3 transformer (e.g. 'lora_unet_down_blocks_0_attentions_0_proj_in.lora_down.weight'")


def test_a_partially_matching_adapter_names_the_first_unmatched_key(base):
    _, _, _, config = base
    path = _rewrite(_kohya(base), base[0] / "partial.safetensors",
                    lambda t: {**t, "diffusion_model.blocks.7.attn.qkv_proj.lora_down.weight": torch.zeros(4, 48),
                               "diffusion_model.blocks.7.attn.qkv_proj.lora_up.weight": torch.zeros(192, 4)})
    _refused(path, config, "2 of its 50 keys match no linear of this MiniMax-H3 transformer, the first 'diffusion_model.blocks.7.attn.qkv_proj.lora_down.weight'")


def test_a_rank_mismatch_is_refused(base):
    _, _, _, config = base
    key = "diffusion_model.blocks.1.mlp.fc2.lora_up.weight"
    path = _rewrite(_kohya(base), base[0] / "rank.safetensors", lambda t: {**t, key: torch.zeros(t[key].shape[0], 3)})
    _refused(path, config, "rank mismatch on blocks.1.mlp.fc2: lora_A/lora_down has rank 4 but lora_B/lora_up 3")


def test_nan_weights_are_refused(base):
    _, _, _, config = base
    key = "diffusion_model.blocks.0.attn.out_proj.lora_down.weight"
    path = _rewrite(_kohya(base), base[0] / "nan.safetensors", lambda t: {**t, key: t[key].index_fill(0, torch.tensor([1]), math.nan)})
    _refused(path, config, f"{key} holds NaN or infinite values")


@pytest.mark.parametrize("mark, kind", [("lokr_w1", "LoKr"), ("hada_w1_a", "LoHa"), ("dora_scale", "DoRA"), ("diff", "a full weight difference")])
def test_a_kind_h3_does_not_apply_is_named(base, mark, kind):
    _, _, _, config = base
    path = _rewrite(_kohya(base), base[0] / f"{mark}.safetensors", lambda t: {**t, f"diffusion_model.blocks.0.attn.qkv_proj.{mark}": torch.zeros(2, 2)})
    _refused(path, config, f"{kind}")


def test_a_file_that_is_no_safetensors_is_one_line(base):
    path = base[0] / "junk.safetensors"
    path.write_bytes(b"not a safetensors file")
    _refused(path, base[3], "not a readable safetensors file")


def test_a_missing_file_is_one_line(base):
    _refused(base[0] / "nowhere.safetensors", base[3], "does not exist")


def test_adaln_targets_on_the_pruned_checkpoint_are_refused_with_the_reason(tmp_path):
    """The pruned file's AdaLN projections read the rank-8 curve: an adapter trained on the full
    model's 2688-wide (here 24-wide) projections cannot apply; its timestep MLP is gone altogether."""
    model = ref.random_model(seed=4)
    full = ref.original_state(model)
    pruned = ref.pruned_state(full, ref.prune(model))
    config = Checkpoint.open(ref.write_single(tmp_path / "pruned.safetensors", pruned), preset("h3")).config
    adaln = lref.kohya_adapter(tmp_path / "adaln.safetensors", full, lref.block_modules(full, adaln=True), seed=1)
    _refused(adaln, config, "it targets blocks.0.adaln_proj.linear with 24 input features, the full model's AdaLN projection; this checkpoint is AdaLN-pruned")
    time_mlp = lref.kohya_adapter(tmp_path / "time.safetensors", full, ["time_embedder.proj_in"], seed=1)
    _refused(time_mlp, config, "it targets time_embedder.proj_in, which this AdaLN-pruned checkpoint does not have")


@pytest.mark.parametrize("text, needle", [("a.safetensors:nan", "not a finite number"), ("a.safetensors:inf", "not a finite number"),
                                          ("a.safetensors:x", "the scale 'x' after the last ':' is not a number")])
def test_a_scale_that_is_not_a_finite_number_is_one_line(text, needle):
    with pytest.raises(AdapterError, match=needle):
        parse_lora(text)


def test_scales_parse_and_a_colon_in_an_existing_path_is_kept(tmp_path):
    odd = tmp_path / "a:b.safetensors"
    odd.write_bytes(b"")
    assert parse_lora("x.safetensors:0.5") == LoraSpec(path=Path("x.safetensors"), scale=0.5)
    assert parse_lora(str(odd)) == LoraSpec(path=odd, scale=1.0)
    with pytest.raises(AdapterError, match="not a finite number"):  # load_transformer(path, loras=[(file, inf)])
        lora_spec(("x.safetensors", float("inf")))


# --- the base is untouched -------------------------------------------------------------------------------


def test_the_base_weights_stay_byte_identical_and_detaching_restores_the_model(base):
    """Attaching, running and detaching adapters changes no byte of any weight (the NVFP4 packed codes and
    scales included); with them off the model computes exactly what it did before."""
    folder, _, path, config = base
    model = load_transformer(path)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    inputs = ref.packed_inputs(ref.random_model(seed=3))
    with torch.no_grad():
        plain = diffusers_forward(model, **inputs)
        attach_adapters(model, [(open_adapter(_kohya(base), config), 1.0), (open_adapter(lref.peft_adapter(folder / "p2.safetensors", seed=2,
                        targets=lref.FULL_TARGETS), config), 0.7)], torch.float32)
        adapted = diffusers_forward(model, **inputs)
        assert set(model.state_dict()) == set(before) and all(
            torch.equal(before[k].view(torch.uint8) if before[k].dtype.itemsize == 1 else before[k], v.view(torch.uint8) if v.dtype.itemsize == 1 else v)
            for k, v in model.state_dict().items())
        detach_adapters(model)
        again = diffusers_forward(model, **inputs)
    assert not branches(model) and all(torch.equal(a, b) for a, b in zip(plain, again))
    assert min(ref.relative_error(a, b) for a, b in zip(adapted, plain)) > 1e-3


# --- the cut ---------------------------------------------------------------------------------------------


def test_a_cut_branch_is_its_share_of_the_whole():
    """rows_cut gives those output rows; columns_cut partials sum to the whole (fp64).

    The rows are the whole's to the up-projection's summation order, not bitwise: the cut's
    `low @ up.T` is a narrower GEMM than the whole's, and MKL picks its kernel (FMA or not, how it
    splits the rank-long sums) by the output's width and the CPU (bitwise on the Xeons this was first
    run on, not on an AMD EPYC). Bound: 2 gamma_R |low| |up|^T with R the block's rank; rows taken one
    off are far outside it (`h3_reference.reorder_bound`)."""
    g = torch.Generator().manual_seed(0)
    down, x = torch.randn(6, 32, generator=g, dtype=torch.float64), torch.randn(5, 32, generator=g, dtype=torch.float64)
    blocks = [UpBlock(Span(0, 8), Span(0, 2), torch.randn(8, 2, generator=g, dtype=torch.float64)),
              UpBlock(Span(8, 24), Span(2, 6), torch.randn(16, 4, generator=g, dtype=torch.float64))]
    branch = LowRankBranch(down, torch.tensor([0.5, 0.5, 2.0, 2.0, 2.0, 2.0], dtype=torch.float32), blocks)
    low = branch.project(x)
    whole = branch.add_to(torch.zeros(5, 24, dtype=torch.float64), low)
    bound = torch.cat([ref.reorder_bound(low[:, b.ranks.start:b.ranks.stop], b.up, accumulate=torch.float64) for b in blocks], 1)
    spans = [Span(2, 5), Span(10, 12), Span(20, 24)]

    def taken(t):
        return torch.cat([t[:, s.start:s.stop] for s in spans], 1)

    cut = branch.rows_cut(spans)
    gap = (cut.add_to(torch.zeros(5, 9, dtype=torch.float64), cut.project(x)) - taken(whole)).abs()
    assert bool((gap <= taken(bound)).all()), (gap - taken(bound)).max()
    one_off = branch.rows_cut([Span(s.start + 1, s.stop + 1) if s.stop < 24 else Span(s.start - 1, s.stop - 1) for s in spans])
    wrong = (one_off.add_to(torch.zeros(5, 9, dtype=torch.float64), one_off.project(x)) - taken(whole)).abs()
    assert not bool((wrong <= taken(bound)).all())
    parts = [branch.columns_cut(c) for c in (Span(0, 16), Span(16, 32))]
    summed = sum(p.add_to(torch.zeros(5, 24, dtype=torch.float64), p.project(x[:, c.start:c.stop])) for p, c in zip(parts, (Span(0, 16), Span(16, 32))))
    assert torch.allclose(summed, whole, rtol=1e-12, atol=1e-12)


# --- the schedule an adapter asks for --------------------------------------------------------------------


def _scheduled(tmp_path, name, **metadata):
    return write_synthetic_adapter(tmp_path / name, preset("tiny"), rank=2, metadata={f"h3.{k}": v for k, v in metadata.items()})


def test_an_adapters_steps_and_shift_are_the_runs_unless_the_user_set_them(tmp_path):
    turbo = LoraSpec(path=_scheduled(tmp_path, "turbo.safetensors", steps="5", video_shift="6"))
    run = resolve(GenerateRequest(loras=(turbo,)))
    assert (run.shape.steps, run.shape.video_shift, run.shape.audio_shift) == (5, 6.0, 3.0) and "turbo.safetensors" in run.shape.schedule_source
    assert resolve(GenerateRequest(loras=(turbo,), steps=5)).shape.steps == 5  # the same value is no conflict
    with pytest.raises(AdapterError, match="--steps 9 contradicts the schedule LoRA turbo.safetensors ships in its metadata"):
        resolve(GenerateRequest(loras=(turbo,), steps=9))


def test_an_explicit_sigma_list_is_sampled_as_given(tmp_path):
    sigmas = [1.0, 0.9, 0.6, 0.0]
    run = resolve(GenerateRequest(loras=(LoraSpec(path=_scheduled(tmp_path, "s.safetensors", video_sigmas=json.dumps(sigmas))),)))
    from h3core.generate.report import Schedules

    schedules = Schedules.of(run.shape)
    assert run.shape.steps == 4 and schedules.video_sigmas == pytest.approx(sigmas) and len(schedules.audio_sigmas) == 4


@pytest.mark.parametrize("metadata, needle", [({"steps": "four"}, "h3.steps='four' is not an integer"),
                                             ({"video_shift": "-1"}, "h3.video_shift='-1' is out of range"),
                                             ({"video_sigmas": "[1, 0.5, 0.7, 0]"}, "must be a JSON list of at least 2 numbers decreasing strictly")])
def test_a_malformed_schedule_is_one_line(tmp_path, metadata, needle):
    with pytest.raises(AdapterError, match=needle):
        resolve(GenerateRequest(loras=(LoraSpec(path=_scheduled(tmp_path, "bad.safetensors", **metadata)),)))


def test_adapters_that_disagree_on_the_schedule_are_refused(tmp_path):
    a, b = (LoraSpec(path=_scheduled(tmp_path, f"{n}.safetensors", steps=s)) for n, s in (("four", "5"), ("eight", "9")))
    with pytest.raises(AdapterError, match="the adapters disagree on the schedule"):
        resolve(GenerateRequest(loras=(a, b)))


def test_the_memory_check_counts_the_adapters(tmp_path):
    """A run's need per rank carries its adapters' bytes, the figure the ranks then measure (tests/dist)."""
    from h3core.generate.memory import generate_need

    spec = LoraSpec(path=write_synthetic_adapter(tmp_path / "a.safetensors", preset("tiny"), rank=16))
    run = resolve(GenerateRequest(loras=(spec,)))
    need = generate_need(run.config, run.plan, run.shape.latent_elements, run.shape.steps, "cpu", torch.float32, "sdpa", False,
                         adapter_bytes=run.adapters[0].bytes_per_rank[0])
    assert need.on_device["adapters"] == run.adapters[0].bytes_per_rank[0] > 0
    assert RunShape.of(run.config, run.request).steps == run.shape.steps


def test_the_dry_run_counts_the_adapters_each_rank_holds(tmp_path, mode="tensor"):
    """`h3 plan --memory --lora`: every rank's live memory after a step grows by exactly its branches'
    bytes as the plan costs them (tensor mode: cut like the linears, less than the whole)."""
    from h3core.generate.dryrun import dry_run, preset_run
    from h3core.parallel.modes import Mode
    from h3core.parallel.plan import ParallelPlan

    spec = LoraSpec(path=write_synthetic_adapter(tmp_path / "a.safetensors", preset("tiny"), rank=16, fmt="peft"))
    plan = ParallelPlan.for_preset("tiny", 2, Mode(mode))
    plain, adapted = (preset_run(plan, "tiny", "cpu", loras=loras) for loras in ((), (spec,)))
    before, after = dry_run(plain, "cpu"), dry_run(adapted, "cpu")
    grown = {r.rank: r.live_after_steps[-1] for r in after.ranks} | {o: r.live_after_steps[-1] for r in after.ranks for o in r.same_as}
    base = {r.rank: r.live_after_steps[-1] for r in before.ranks} | {o: r.live_after_steps[-1] for r in before.ranks for o in r.same_as}
    assert [grown[i] - base[i] for i in range(2)] == adapted.adapters[0].bytes_per_rank
    if mode == "tensor":
        whole = preset_run(ParallelPlan.for_preset("tiny", 1, Mode(mode)), "tiny", "cpu", loras=(spec,)).adapters[0].bytes_per_rank[0]
        assert max(adapted.adapters[0].bytes_per_rank) < whole


def test_with_decoded_weights_held_the_branch_gives_the_same_bits(tmp_path):
    """`--decoded-weights on` (the NVFP4 linears held decoded, here in float32 on the CPU) keeps the
    branch a branch: the latents are bitwise those of decoding per forward."""
    from h3core.generate.run import execute

    spec = LoraSpec(path=write_synthetic_adapter(tmp_path / "a.safetensors", preset("tiny"), rank=8, std=0.1))
    runs = [resolve(GenerateRequest(steps=3, loras=(spec,), decoded_weights=choice)) for choice in ("on", "off")]
    assert [r.plan.decoded.held for r in runs] == [True, False]
    (on,), (off,) = (execute(r) for r in runs)
    assert all(torch.equal(on.latents[k], off.latents[k]) for k in ("video", "audio"))
