#!/usr/bin/env python3
"""What `--compile` buys per step and costs once: the same request on one rank, eager and with the
repeated block compiled (h3core.model.compiled), alternating in one run; the median step of each,
their ratio, the compile time apart, and how far the compiled latents are from the eager ones.

Both arms are pipelines loaded side by side in this process from the preset's synthetic checkpoint.
The compiled arm runs once first: that run compiles every shape the request meets (its compile
seconds are printed apart, as `h3 generate --compile` reports them) and is not timed. Then the arms
alternate A, B, B, A, A, B, ...; a run's figure is its median step, an arm's the median over its
runs, and the ratio is the median of the per-pair ratios (compiled / eager; < 1: compiled is faster).

    python scripts/bench_compile.py                              # tiny, 4 sigma points, 5 runs per arm
    python scripts/bench_compile.py --preset narrow --repeat 7 --device cuda --dtype bf16
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

from h3core.bench.alternate import Spread, alternate, ratios
from h3core.generate.pipeline import RankPipeline, encode_prompts, new_record, rank_runtime
from h3core.generate.request import GenerateRequest, resolve
from h3core.model.compiled import CompiledBlocks
from h3core.runtime.context import RankContext


def one_rank(device: str) -> RankContext:
    """This process as a world of one on `device` (cuda: the first GPU)."""
    return RankContext(0, 1, 0, torch.device("cuda", 0) if device == "cuda" else torch.device(device), None, "none")


def loaded(request: GenerateRequest, compiled: bool):  # -> (ctx, run, given, pipeline)
    ctx = one_rank(request.device)
    run = resolve(request)
    runtime = rank_runtime(ctx, run)
    given = encode_prompts(ctx, run, runtime, new_record(ctx))
    pipeline = RankPipeline.load(ctx, run, runtime)
    if compiled:
        pipeline.compiled = CompiledBlocks(pipeline.model)
    return ctx, run, given, pipeline


def denoised(arm) -> tuple[dict, list[float], float]:  # noqa: ANN001 - what `loaded` returns
    """One request on `arm`: its latents, its step seconds, and the seconds it spent compiling."""
    ctx, run, given, pipeline = arm
    record = new_record(ctx)
    latents = pipeline.denoise(run, given, record)
    return latents, record.step_seconds, record.compile.seconds if record.compile is not None else 0.0


def relative(a: dict, b: dict) -> float:
    """max |a - b| / max |b| over every kind of latent rows."""
    return max(((a[k] - b[k]).abs().max() / b[k].abs().max()).item() for k in b)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--steps", type=int, default=4, help="Sigma points per run (steps - 1 forwards).")
    parser.add_argument("--repeat", type=int, default=5, help="Runs per arm.")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None, help="fp32, bf16 (default: the device's).")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's).")
    parser.add_argument("--json", type=Path, default=None, help="Also write the figures here.")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    request = GenerateRequest(preset=args.preset, steps=args.steps, device=args.device, dtype=args.dtype)
    eager, compiled = loaded(request, compiled=False), loaded(request, compiled=True)
    first_latents, _, compile_seconds = denoised(compiled)  # compiles every shape of the request
    reference, _, _ = denoised(eager)
    recompiled = [0.0]

    def median_step(arm) -> float:  # noqa: ANN001 - what `loaded` returns
        _, seconds, spent = denoised(arm)
        recompiled[0] += spent
        return statistics.median(seconds)

    steps = alternate({"eager": lambda: median_step(eager), "compiled": lambda: median_step(compiled)}, args.repeat, warmup=0)
    pair_ratios = ratios(steps["compiled"], steps["eager"])
    result = {
        "preset": args.preset, "device": args.device, "dtype": str(eager[3].dtype), "threads": torch.get_num_threads(), "steps": args.steps,
        "repeat": args.repeat, "compile_seconds": compile_seconds, "compile_seconds_in_timed_runs": recompiled[0],
        "median_step_eager": statistics.median(steps["eager"]), "median_step_compiled": statistics.median(steps["compiled"]),
        "ratio_compiled_over_eager": statistics.median(pair_ratios), "ratio_spread": Spread.of(pair_ratios).model_dump(), "ratios": pair_ratios, "runs": steps,
        "relative_difference": relative(first_latents, reference), "fullgraph": compiled[3].compiled.fullgraph,
    }
    print(f"--compile on {args.preset}, 1 {args.device} rank, {result['dtype']}, {result['threads']} thread(s), {args.steps - 1} forwards per run, "
          f"median of {args.repeat} runs per arm, alternating")
    print(f"compile: {compile_seconds:.1f}s once (the first run, not timed; {recompiled[0]:.1f}s more in the timed runs)")
    print(f"median step: eager {result['median_step_eager']:.4f}s · compiled {result['median_step_compiled']:.4f}s · "
          f"compiled / eager {result['ratio_compiled_over_eager']:.3f} (pairs: {' '.join(f'{r:.3f}' for r in pair_ratios)})")
    print(f"latents: compiled vs eager relative {result['relative_difference']:.3g}")
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
