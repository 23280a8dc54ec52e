#!/usr/bin/env python3
"""Measure what `h3core.generate.parity`'s bounds are derived from, and print the bounds they give.

A distributed run differs from the one-rank run only where an operation is computed another way:
Ulysses multiplies a rank's rows (a GEMM of fewer rows can take another kernel), tensor mode sums
row-parallel partials in another order. Three measurements (docs/verify.md has the derivation):

1. delta: one linear computed the distributed way vs the one-rank way, max |diff| / max |y|, over
   every linear of the preset (NVFP4 and dense), 2..8 ranks, a few sequence lengths; per mode and
   dtype, in units of the dtype's eps (torch.finfo(dtype).eps: 2^-23 fp32, 2^-7 bf16, 2^-10 fp16).
2. A: how much a relative perturbation of every linear's output grows by the final latents: one-rank
   runs with every linear output multiplied by (1 + eps * r), r = +-1 at random, vs the clean run;
   A = relative latent difference / eps (eps = 1e-6: far above fp32 rounding, far below nonlinearity).
3. e_q: the fp4 path's activation quantization noise at the latents: the emulated fp4 run vs the
   weight-only run, one rank (what a single flipped fp4 code can grow into, see docs/verify.md).

    python scripts/derive_parity_bounds.py                          # tiny and narrow, 2 and 4 forwards
    python scripts/derive_parity_bounds.py --presets tiny --steps 3 --json bounds.json

Runs on the CPU at 1 thread (as every rank of an 8-rank CPU World does); about two minutes.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from h3core.generate import parity
from h3core.generate.parity import latent_parity
from h3core.generate.request import GenerateRequest, resolve
from h3core.generate.run import one_rank_latents
from h3core.model.checkpoint import Checkpoint
from h3core.model.config import preset
from h3core.model.synthetic import synthetic_checkpoint
from h3core.nvfp4.codec import dequantize
from h3core.nvfp4.linear import DenseLinear, NVFP4Linear
from h3core.parallel.partition import nvfp4_column_slices, token_spans
from h3core.parallel.modes import Mode
from h3core.reports.schema import error_between

NEGATIVE_PROMPT = "blurry, low quality, distorted"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
COUNTS = range(2, 9)
LENGTHS = (10, 97, 147)
PERTURBATION = 1e-6


def linears(preset_name: str) -> list[tuple[str, torch.nn.Module]]:
    cfg = preset(preset_name)
    model = Checkpoint.open(synthetic_checkpoint(cfg)[0], cfg).load()
    return [(n, m) for n, m in model.named_modules() if isinstance(m, (NVFP4Linear, DenseLinear))]


def _dense(module: torch.nn.Module, dtype: torch.dtype) -> torch.Tensor:
    weight = dequantize(module.nvfp4) if isinstance(module, NVFP4Linear) else module.weight
    return weight.to(dtype)  # [out, in]


def rows_delta(weight: torch.Tensor, x: torch.Tensor) -> float:
    """Ulysses: each rank's rows multiplied on their own vs rows of the whole product."""
    full = x @ weight.T
    worst = 0.0
    for count in COUNTS:
        parts = torch.cat([x[s.start : s.stop] @ weight.T for s in token_spans(x.shape[0], count)])
        worst = max(worst, _relative(parts, full))
    return worst


def columns_delta(weight: torch.Tensor, x: torch.Tensor) -> float:
    """Tensor mode: partials over block-aligned input columns, each in the dtype, summed in fp32 in
    rank order and rounded once (as `reduce_scatter_rows` does), vs the whole product."""
    full = x @ weight.T
    worst = 0.0
    for count in COUNTS:
        if x.shape[1] // 16 < count:
            continue
        total = torch.zeros(full.shape)
        for cols in nvfp4_column_slices(x.shape[1], count):
            span = cols.elements
            total += (x[:, span.start : span.stop] @ weight[:, span.start : span.stop].T).float()
        worst = max(worst, _relative(total.to(x.dtype), full))
    return worst


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    diff, scale = error_between(a, b)  # h3's one error metric: max |a - b| and max |b|
    return diff / scale


def measure_delta(presets: list[str]) -> dict[str, dict[str, float]]:
    """{mode: {dtype: delta in eps units}}; tensor mode only over the row-parallel layers (Out, FC2)."""
    out: dict[str, dict[str, float]] = {m.value: {} for m in Mode}
    for name in presets:
        for layer, module in linears(name):
            row_parallel = layer.endswith(("attn.out_proj", "mlp.fc2"))  # the layers tensor mode splits by input column
            for key, dtype in DTYPES.items():
                weight, eps = _dense(module, dtype), torch.finfo(dtype).eps
                for length in LENGTHS:
                    x = torch.randn(length, weight.shape[1], generator=torch.Generator().manual_seed(length)).to(dtype)
                    ulysses = rows_delta(weight, x) / eps
                    out["ulysses"][key] = max(out["ulysses"].get(key, 0.0), ulysses)
                    if row_parallel:
                        tensor = columns_delta(weight, x) / eps
                        out["tensor"][key] = max(out["tensor"].get(key, 0.0), tensor)
    return out


def _perturbed(eps: float, seed: int):  # type: ignore[no-untyped-def]
    """A Checkpoint.load wrapper whose model multiplies every linear's output by (1 + eps * r)."""
    original = Checkpoint.load

    def load(self, **kwargs):  # type: ignore[no-untyped-def]
        model = original(self, **kwargs)
        generator = torch.Generator().manual_seed(seed)

        def hook(module, args, y):  # type: ignore[no-untyped-def]
            r = torch.randint(0, 2, y.shape, generator=generator).to(y.dtype) * 2 - 1
            return y * (1 + eps * r)

        for module in model.modules():
            if isinstance(module, (NVFP4Linear, DenseLinear)):
                module.register_forward_hook(hook)
        return model

    return original, load


def run_latents(name: str, steps: int, guidance: float, perturb: tuple[float, int] | None = None, emulate: bool = False):  # type: ignore[no-untyped-def]
    run = resolve(GenerateRequest(preset=name, steps=steps, guidance_scale=guidance, negative_prompt=NEGATIVE_PROMPT))
    NVFP4Linear.emulate_fp4 = emulate
    original = Checkpoint.load
    if perturb is not None:
        original, Checkpoint.load = _perturbed(*perturb)
    try:
        return one_rank_latents(run, threads=1)
    finally:
        Checkpoint.load = original
        NVFP4Linear.emulate_fp4 = None


def measure_amplification(presets: list[str], steps: list[int], guidances: list[float]) -> list[dict]:
    rows = []
    for name in presets:
        for step_count in steps:
            for guidance in guidances:
                clean = run_latents(name, step_count, guidance)
                worst = max(
                    latent_parity(run_latents(name, step_count, guidance, (PERTURBATION, seed)), clean, 0.0, "clean").relative
                    for seed in (0, 1)
                )
                emulated = run_latents(name, step_count, guidance, emulate=True)
                e_q = latent_parity(emulated, clean, 0.0, "weight-only").relative
                rows.append(dict(preset=name, steps=step_count, guidance=guidance, amplification=worst / PERTURBATION, fp4_noise=e_q))
                print(f"  {name:<7} steps {step_count} guidance {guidance:g}: A = {worst / PERTURBATION:6.2f}   fp4 quantization noise e_q = {e_q:.3f}", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", default="tiny,narrow")
    parser.add_argument("--steps", default="3,5", help="sigma points (steps - 1 forwards)")
    parser.add_argument("--guidance", default="1,3")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    presets = args.presets.split(",")
    print("delta: one linear, distributed vs one rank (max |diff| / max |y|), in eps of the dtype")
    delta = measure_delta(presets)
    for mode, by_dtype in delta.items():
        print(f"  {mode:<8} " + "  ".join(f"{k} {v:5.2f}" for k, v in by_dtype.items()))
    print(f"A: relative latent change per relative perturbation {PERTURBATION:g} of every linear output (max of 2 seeds)")
    amp = measure_amplification(presets, [int(s) for s in args.steps.split(",")], [float(g) for g in args.guidance.split(",")])
    a_max, e_q = max(r["amplification"] for r in amp), max(r["fp4_noise"] for r in amp)
    print(f"\nmeasured: A <= {a_max:.2f} (assumed {parity.AMPLIFICATION:g}), e_q <= {e_q:.3f} (assumed {parity.FP4_QUANTIZATION_NOISE:g})")
    print("bounds (SAFETY x A x delta; fp4 with half-precision GEMM output: SAFETY x 2 x e_q):")
    ok = a_max <= parity.AMPLIFICATION and e_q <= parity.FP4_QUANTIZATION_NOISE
    for mode, (name, dtype) in ((m, d) for m in Mode for d in DTYPES.items()):
        ulps = parity.rounding_ulps(mode, dtype)
        measured = delta[mode.value].get(name, math.nan)
        ok &= measured <= ulps
        print(f"  {mode.value:<8} {name}: delta measured {measured:5.2f} eps, assumed {ulps:g} -> bound {parity.tolerance(mode, dtype):.3g}")
    print(f"  fp4 half output: bound {parity.FP4_HALF_TOLERANCE:.3g}")
    print("parity.py's constants cover these measurements" if ok else "MEASURED ABOVE parity.py's CONSTANTS: raise them")
    if args.json:
        args.json.write_text(json.dumps({"delta_eps": delta, "amplification": amp}, indent=2) + "\n")
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
