#!/usr/bin/env python3
"""The default command against `python -c "import torch"` (issue 35.6): `h3 generate` with no flags
(the tiny preset, synthetic weights) and the bare torch import, each a fresh process, alternating
in one run; the median of N of each, their ratio (target: at most 3x), and the median of each
stage of the run's own wall-time split (`report.json`'s `wall`).

    python scripts/bench_default.py --repeat 5
    python scripts/bench_default.py --repeat 5 --before ../h3-main   # another checkout's h3 generate too

Every process starts in a fresh temporary folder (where `h3 generate` writes its `outputs/`), with
this tree (or `--before`'s) first on PYTHONPATH; the synthetic files are made once, before timing.
Timed warm: the files and Python's bytecode are in the page cache for every arm alike.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
STAGES = ("start", "resolve", "ranks_start", "text", "denoise", "decode", "write")


def timed(command: list[str], tree: Path | None) -> tuple[float, dict | None]:
    """Wall seconds of one fresh process in a fresh folder, and its run's wall split (None for torch)."""
    env = dict(os.environ)
    if tree is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(tree), *filter(None, [os.environ.get("PYTHONPATH", "")])])
    with tempfile.TemporaryDirectory(prefix="h3-bench-default-") as cwd:
        began = time.perf_counter()
        proc = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True)
        seconds = time.perf_counter() - began
        if proc.returncode != 0:
            sys.exit(f"{' '.join(command)} failed: {proc.stderr.strip().splitlines()[-1:]}")
        reports = list(Path(cwd).glob("outputs/*/report.json"))
        return seconds, (json.loads(reports[0].read_text()).get("wall") if reports else None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=5, help="runs of each arm (median of these)")
    parser.add_argument("--before", type=Path, help="another checkout whose h3 generate runs as a third arm")
    args = parser.parse_args()
    generate = [sys.executable, "-m", "h3cli.main", "generate"]
    arms: dict[str, tuple[list[str], Path | None]] = {"import torch": ([sys.executable, "-c", "import torch"], None), "h3 generate": (generate, HERE)}
    if args.before is not None:
        arms["h3 generate (before)"] = (generate, args.before.resolve())
    for command, tree in arms.values():
        timed(command, tree)  # warm-up: synthetic files, bytecode, page cache
    seconds: dict[str, list[float]] = {name: [] for name in arms}
    walls: dict[str, list[dict]] = {name: [] for name in arms}
    for round_ in range(args.repeat):
        order = list(arms) if round_ % 2 == 0 else list(reversed(arms))
        for name in order:
            took, wall = timed(*arms[name])
            seconds[name].append(took)
            walls[name].extend([wall] if wall else [])
    base = statistics.median(seconds["import torch"])
    print(f"median of {args.repeat}, alternating, warm page cache, load average {os.getloadavg()[0]:.2f}")
    for name in arms:
        median = statistics.median(seconds[name])
        print(f"  {name:22s} {median:6.2f} s  ({median / base:.2f}x import torch)  runs: {', '.join(f'{s:.2f}' for s in seconds[name])}")
        if walls[name]:
            split = " · ".join(f"{stage} {statistics.median(w.get(stage) or 0.0 for w in walls[name]):.2f}" for stage in STAGES)
            loads = " · ".join(f"load {part} {statistics.median(w['load'].get(part, 0.0) for w in walls[name]):.2f}" for part in walls[name][0]["load"])
            print(f"  {'':22s} wall split (median s): {split} · {loads}")


if __name__ == "__main__":
    main()
