#!/usr/bin/env python3
"""CFG parallel at 2 ranks against 2 ranks without it, guidance on, side by side in one run.

Without CFG parallel both ranks run both sequences (the prompt's, then the negative prompt's), each
split over the two ranks (Ulysses: two all-to-alls per block; tensor: two all-gathers and two
reduce-scatters per block). With it each rank runs one whole sequence (rank 0 the prompt's, rank 1
the negative prompt's) and they exchange their velocities once per step. The limit of the gain is
what splitting one sequence costs: the collectives and the smaller GEMMs on half the rows.

The variants (ulysses x2, tensor x2, CFG parallel x2) run in one kept 2-rank World, alternating in a
rotating order so that drift on a shared machine hits them alike; each figure is the median over
--repeat runs of the steady step time (per step the slowest rank, then the median of the steps after
the first, as `h3 matrix` counts it). The default preset, wide-1k, takes about 2 s per sequence
forward on one CPU thread.

    python scripts/bench_cfg_parallel.py --preset wide-1k --steps 3 --repeat 3
"""

from __future__ import annotations

import argparse
import os
import statistics

from rich.console import Console
from rich.table import Table

from h3core.generate.pipeline import rank_generate
from h3core.generate.request import GenerateRequest, resolve
from h3core.parallel.modes import Mode
from h3core.reports.units import format_bytes
from h3core.runtime.device import resolve_device
from h3core.runtime.world import World

VARIANTS = {"ulysses x2": (Mode.ULYSSES, False), "tensor x2": (Mode.TENSOR, False), "cfg-parallel x2": (Mode.ULYSSES, True)}


def measure(world: World, run) -> tuple[float, int]:  # type: ignore[no-untyped-def]
    """(steady step seconds, bytes rank 0 sent per step) of one run in `world`."""
    outcomes = world.run(rank_generate, run)
    slowest = [max(o.step_seconds[i] for o in outcomes) for i in range(len(outcomes[0].step_seconds))]
    comm = outcomes[0].comm
    sent = comm.bytes_sent - (comm.kinds["broadcast"].bytes_sent if "broadcast" in comm.kinds else 0)
    return statistics.median(slowest[1:] or slowest), sent // len(slowest)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="wide-1k")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--guidance", type=float, default=3.0)
    parser.add_argument("--device", default="auto")
    args = parser.parse_args()
    device = resolve_device(args.device)
    runs = {
        name: resolve(GenerateRequest(preset=args.preset, steps=args.steps, guidance_scale=args.guidance, negative_prompt="blurry, low quality",
                                      mode=mode, world_size=2, cfg_parallel=cfg, device=device))
        for name, (mode, cfg) in VARIANTS.items()
    }
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    sent: dict[str, int] = {}
    console = Console()
    console.print(f"load average before: {os.getloadavg()}")
    with World(2, device) as world:
        names = list(runs)
        for i in range(args.repeat):
            for name in names[i % len(names):] + names[: i % len(names)]:  # rotating order
                step, sent[name] = measure(world, runs[name])
                seconds[name].append(step)
                console.print(f"  round {i + 1} {name}: {step:.3f} s/step")
    console.print(f"load average after: {os.getloadavg()}")
    _table(console, args, seconds, sent)


def _table(console: Console, args, seconds: dict[str, list[float]], sent: dict[str, int]) -> None:  # type: ignore[no-untyped-def]
    cfg = statistics.median(seconds["cfg-parallel x2"])
    table = Table(title=f"{args.preset}, guidance {args.guidance}, {args.steps} steps, 2 ranks: median of {args.repeat} steady step times", title_justify="left")
    for col in ("variant", "step", "runs", "vs cfg-parallel", "sent per step (rank 0, no broadcast)"):
        table.add_column(col)
    for name, values in seconds.items():
        median = statistics.median(values)
        table.add_row(name, f"{median:.3f} s", " ".join(f"{v:.3f}" for v in values), f"{median / cfg:.2f}x", format_bytes(sent[name]))
    console.print(table)


if __name__ == "__main__":
    main()
