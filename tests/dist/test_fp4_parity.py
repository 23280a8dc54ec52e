"""The fp4 path gives the one-rank result at every world size: Gloo ranks run the whole pipeline on
the `cpu-fp4-emulated` path (activations quantized with the agreed global scale, padded operands,
swizzled scales, an emulated GEMM) at 2, 4, 6 and 8 ranks in both modes, against one rank.

Two checkpoints: the synthetic one, laid out as the seed's file (no `input_scale`: each linear's
activation scale is the amax of its whole input, agreed by an all-reduce MAX over the ranks that
split it), and the same with a static `input_scale` on every NVFP4 linear (as a ModelOpt export
carries). The tiny preset's shards are ragged: fc2's 22 blocks give odd block counts at 6 and 8
ranks (K padded to 32), out_proj shards of one 16-wide head at 6 and 8 ranks. Errors are printed (`-s`)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from h3core.files.safetensors import read_header
from h3core.generate.parity import latent_parity, tolerance
from h3core.generate.pipeline import rank_generate
from h3core.generate.request import GenerateRequest, resolve
from h3core.nvfp4.linear import NVFP4Linear
from h3core.nvfp4.matmul import PATH_CPU_FP4_EMULATED
from h3core.parallel.modes import Mode
from h3core.parallel.runtime import ParallelRuntime
from h3core.verify.session import as_world_of_one

COUNTS = [2, 4, 6, 8]
GUIDED = dict(preset="tiny", steps=2, guidance_scale=3.0, negative_prompt="blurry, low quality, distorted")


# --- rank side -----------------------------------------------------------------------------------


def _emulated_generate(ctx, count, run, agree=True, codes_first=True):
    """World task: the pipeline on ranks 0..count-1 with fp4 emulation on (and the scale agreement
    switched off when `agree` is False; tensor mode gathering rows, not codes, when `codes_first` is
    False); rank 0 returns latents, every rank its paths."""
    from h3core.parallel.modes import tensor

    sub = ctx.first_ranks(count) if count > 1 else (as_world_of_one(ctx) if ctx.rank == 0 else None)
    if sub is None:
        return None
    real_agree = ParallelRuntime.agree_activation_scales
    NVFP4Linear.emulate_fp4 = True
    tensor.QUANTIZE_BEFORE_GATHER = codes_first
    if not agree:
        ParallelRuntime.agree_activation_scales = lambda self, linears: None
    try:
        outcome = rank_generate(sub, run)
    finally:
        NVFP4Linear.emulate_fp4 = None
        tensor.QUANTIZE_BEFORE_GATHER = True
        ParallelRuntime.agree_activation_scales = real_agree
    return {"latents": outcome.latents if sub.rank == 0 else None, "paths": outcome.nvfp4_paths, "comm": outcome.comm, "shapes": outcome.fp4_gemm_shapes}


# --- this process ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{'dynamic': the synthetic checkpoint (no input scales, as the seed's), 'static': the same with them}."""
    synthetic = resolve(GenerateRequest(**GUIDED)).checkpoint
    static = tmp_path_factory.mktemp("fp4") / "input-scales.safetensors"
    _, _, metadata = read_header(synthetic)
    tensors = load_file(str(synthetic))
    for name in [k for k in tensors if k.endswith(".comfy_quant")]:  # |x| up to 16 quantizes unsaturated
        tensors[name.replace(".comfy_quant", ".input_scale")] = torch.tensor(16.0 / (6 * 448))
    save_file(tensors, str(static), metadata=metadata)
    return {"static": static, "dynamic": None}


def _run(scales, checkpoints, mode, count):
    return resolve(GenerateRequest(**GUIDED, mode=mode, world_size=count, model_path=checkpoints[scales]))


@pytest.fixture(scope="module")
def references(world8, checkpoints):
    """One rank per checkpoint (Ulysses; tensor mode at one rank is the same identity path)."""
    return {s: world8.run(_emulated_generate, 1, _run(s, checkpoints, Mode.ULYSSES, 1))[0] for s in checkpoints}


@pytest.mark.parametrize("scales", ["static", "dynamic"])
@pytest.mark.parametrize("mode", list(Mode))
def test_fp4_path_matches_one_rank_at_every_count(world8, checkpoints, references, scales, mode):
    reference = references[scales]
    assert reference["paths"].keys() == {PATH_CPU_FP4_EMULATED}
    bound = tolerance(mode, torch.float32)
    for count in COUNTS:
        results = world8.run(_emulated_generate, count, _run(scales, checkpoints, mode, count))[:count]
        parity = latent_parity(results[0]["latents"], reference["latents"], bound, "1 rank")
        print(f"fp4 emulated, {scales} scales, {mode.value} x{count}: relative {parity.relative:.3g} (bound {bound:.3g})")
        assert parity.passed, parity
        for rank, result in enumerate(results):  # every rank took the fp4 path for every linear call
            assert result["paths"].keys() == {PATH_CPU_FP4_EMULATED}, (rank, result["paths"])
        agreed = sum(r["comm"].kinds.get("all_reduce_max", _zero()).calls for r in results)
        assert (agreed > 0) == (scales == "dynamic")  # static scales need no agreement


def _zero():
    from h3core.parallel.collectives import CollectiveCounts

    return CollectiveCounts()


@pytest.mark.parametrize("mode", list(Mode))
def test_without_the_agreement_ranks_quantize_differently(world8, checkpoints, references, mode):
    """The bug the agreement fixes: each rank's scale from its own rows (Ulysses) or columns
    (tensor mode) moves the latents by orders of magnitude more than the bound."""
    result = world8.run(_emulated_generate, 2, _run("dynamic", checkpoints, mode, 2), False)[0]
    parity = latent_parity(result["latents"], references["dynamic"]["latents"], tolerance(mode, torch.float32), "1 rank")
    print(f"fp4 emulated, no agreement, {mode.value} x2: relative {parity.relative:.3g} (bound {parity.tolerance:.3g})")
    assert parity.relative > 100 * parity.tolerance


@pytest.mark.parametrize("mode", list(Mode))
def test_the_dry_run_predicts_every_fp4_gemm_shape_the_ranks_run(world8, checkpoints, mode):
    """What the fp4 self-test before a CUDA run checks (`h3core.generate.fp4gate`) is the set of GEMM
    shapes the dry run of the ranks' own code called on simulated sm_120 GPUs: here it is held against
    the shapes real ranks ran on the CPU's fp4 path (the same code from the GEMM's padding on), at
    6 ranks (ragged heads and fc2 blocks), for both sequences of a guided run."""
    from h3core.generate import dryrun

    from h3core.runtime import fake_cuda

    if dryrun.dry_run_problem("sm_120") == fake_cuda.NO_COMPILER:  # any other problem fails the dry run below
        pytest.skip(f"no fake CUDA here: {fake_cuda.NO_COMPILER}")
    run = _run("dynamic", checkpoints, mode, 6)
    ran = sorted({tuple(s) for r in world8.run(_emulated_generate, 6, run)[:6] for s in r["shapes"]})
    on_gpu = run.model_copy(update={"request": run.request.model_copy(update={"device": "cuda"})})
    predicted = [tuple(s) for s in dryrun.dry_run(on_gpu, "sm_120").gemm_shapes()]
    assert ran and predicted == ran


@pytest.mark.parametrize("scales", ["static", "dynamic"])
def test_tensor_mode_gathers_codes_bitwise_as_it_gathered_rows(world8, checkpoints, scales):
    """Quantize-before-gather (tensor mode on the fp4 paths) gives the bits of gathering the rows and
    quantizing the whole sequence, at ragged counts, and its row gathers move a fraction of the bytes:
    K/2 + K/16 bytes a row of codes and scales for 4K bytes a float32 row (2K in bf16)."""
    for count in (2, 6):
        run = _run(scales, checkpoints, Mode.TENSOR, count)
        codes = world8.run(_emulated_generate, count, run)[:count]
        rows = world8.run(_emulated_generate, count, run, True, False)[:count]
        for kind in ("video", "audio"):
            assert torch.equal(codes[0]["latents"][kind], rows[0]["latents"][kind]), (scales, count, kind)
        sent = [sum(r["comm"].kinds["gather_rows"].bytes_sent for r in result) for result in (codes, rows)]
        print(f"tensor x{count}, {scales} scales: gather_rows sent {sent[0]:,} bytes with codes, {sent[1]:,} with rows")
        assert sent[0] < 0.3 * sent[1]  # the gathers before qkv and fc1 are most of them; fp32 rows 4K vs 9K/16
