#!/usr/bin/env python3
"""What a LoRA adapter costs per step: `h3 generate` without and with a rank-64 adapter, alternating
in one run, the median step time of each and their ratio.

Both arms are the same request on one CPU rank in this process (the preset's synthetic checkpoint in
the seed's layout, NVFP4 block linears); the adapter is a synthetic rank-64 one in the kohya layout
on every block's and refiner block's qkv, out, fc1 and fc2 (what the published H3 adapters adapt,
docs/lora.md), applied as a branch beside each linear. Arms alternate A, B, B, A, A, B, ...; a run's
figure is its median step after the first (the first carries one-time warm-up), an arm's the median
over its runs. Beside the measured ratio it prints the branches' share of the adapted linears'
multiply-adds, at this shape and at H3's (`r (in + out)` against `in x out` per linear): a narrow
CPU preset overstates what rank 64 costs on H3's 5376-wide linears.

    python scripts/bench_lora.py                        # wide-1k, 3 sigma points, 5 runs per arm
    python scripts/bench_lora.py --preset narrow-1k --repeat 7 --rank 64
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from h3core.generate.request import GenerateRequest, resolve
from h3core.generate.run import execute
from h3core.lora.spec import LoraSpec
from h3core.lora.synthetic import BLOCK_LINEARS, write_synthetic_adapter
from h3core.model.config import ModelConfig, preset


def branch_share(config: ModelConfig, rank: int) -> float:
    """Multiply-adds of rank-`rank` branches on every block linear over those of the linears themselves."""
    shapes = [(3 * config.attention_width, config.hidden), (config.hidden, config.attention_width),
              (2 * config.ffn_dim, config.hidden), (config.hidden, config.ffn_dim)]
    return sum(rank * (o + i) for o, i in shapes) / sum(o * i for o, i in shapes)


def median_step(request: GenerateRequest) -> float:
    """Median step after the first of one run of `request` on one CPU rank in this process."""
    (outcome,) = execute(resolve(request))  # type: ignore[misc]
    steps = outcome.step_seconds
    return statistics.median(steps[1:] or steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="wide-1k")
    parser.add_argument("--steps", type=int, default=3, help="Sigma points per run (steps - 1 forwards).")
    parser.add_argument("--repeat", type=int, default=5, help="Runs per arm.")
    parser.add_argument("--rank", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1, help="CPU threads of the run (1 keeps a shared machine's noise down).")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    config = preset(args.preset)
    with tempfile.TemporaryDirectory() as folder:
        adapter = write_synthetic_adapter(Path(folder) / f"rank{args.rank}.safetensors", config, rank=args.rank, linears=BLOCK_LINEARS)
        base = dict(preset=args.preset, steps=args.steps, device="cpu")
        arms = [("without", GenerateRequest(**base)), (f"rank-{args.rank} adapter", GenerateRequest(**base, loras=(LoraSpec(path=adapter),)))]
        runs: dict[str, list[float]] = {label: [] for label, _ in arms}
        for i in range(args.repeat):
            for label, request in arms if i % 2 == 0 else arms[::-1]:
                runs[label].append(median_step(request))
    medians = {label: statistics.median(times) for label, times in runs.items()}
    reference = arms[0][0]
    table = Table(title=f"h3 generate --preset {args.preset} --steps {args.steps} · 1 CPU rank, {args.threads} thread(s) · median of {args.repeat} runs per arm, alternating",
                  title_justify="left")
    for column in ("arm", "median step s", "runs (median step each)", f"vs {reference}"):
        table.add_column(column)
    for label, times in runs.items():
        table.add_row(label, f"{medians[label]:.3f}", " ".join(f"{t:.3f}" for t in times), f"{medians[label] / medians[reference]:.3f}x")
    console = Console(width=200)
    console.print(table)
    console.print(f"branch multiply-adds over the block linears': {branch_share(config, args.rank):.1%} at {args.preset}, "
                  f"{branch_share(preset('h3'), args.rank):.1%} at H3's widths (rank {args.rank})")


if __name__ == "__main__":
    main()
