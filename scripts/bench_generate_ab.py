#!/usr/bin/env python3
"""Two variants of `h3 generate`, alternating in one run: the median step time of each and their ratio.

Each run is a fresh `h3 generate ... --json` process (so a process-wide setting such as the CPU
allocator policy really differs between arms); arms alternate A, B, B, A, A, B, ... so that drift
on a shared machine hits both alike. A run's figure is its median step after the first (the first
carries one-time warm-up); an arm's figure is the median over its runs.

    python scripts/bench_generate_ab.py allocator --preset narrow --repeat 5    # H3_CPU_ALLOCATOR system vs retain
    python scripts/bench_generate_ab.py profile --preset narrow-1k --repeat 5   # --profile off vs on
    python scripts/bench_generate_ab.py allocator --preset narrow-1k -- ulysses 2  # extra h3 generate arguments
    python scripts/bench_generate_ab.py trees --before ../h3-old --preset narrow-1k  # another checkout vs this one

`trees` runs the same command from another checkout (`git worktree add ../h3-old <commit>`) and from
this one, each by PYTHONPATH (the processes start in a temporary folder, so neither tree's folder
shadows the other), with the same installed dependencies.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

ARMS = {
    # name: [(label, extra args, extra environment), (label, ...)]; the first arm is the reference.
    "allocator": [("system (glibc defaults)", [], {"H3_CPU_ALLOCATOR": "system"}), ("retain", [], {"H3_CPU_ALLOCATOR": "retain"})],
    "profile": [("profile off", [], {}), ("--profile", ["--profile"], {})],
    "trees": [],  # built from --before in main()
}
HERE = Path(__file__).resolve().parent.parent


def one_run(args: list[str], env: dict[str, str], out: str, cwd: str) -> float:
    """Median step after the first of one `h3 generate` process."""
    command = [sys.executable, "-m", "h3cli.main", "generate", *args, "--json", "--no-save-latents", "--output", out, "--overwrite"]
    proc = subprocess.run(command, capture_output=True, text=True, env={**os.environ, **env}, cwd=cwd)
    if proc.returncode != 0:
        sys.exit(f"h3 generate failed ({' '.join(args)}): {proc.stderr.strip()}")
    steps = json.loads(proc.stdout)["step_seconds"]
    return statistics.median(steps[1:] or steps)


def tree_arms(before: Path | None) -> list[tuple[str, list[str], dict[str, str]]]:
    """`trees`: the checkout `before`, then this one, each imported through PYTHONPATH."""
    if before is None or not (before / "h3core").is_dir():
        sys.exit("trees needs --before PATH: a checkout of h3 (e.g. git worktree add ../h3-old HEAD~1)")
    return [(f"before ({before})", [], {"PYTHONPATH": str(before.resolve())}), ("this tree", [], {"PYTHONPATH": str(HERE)})]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("compare", choices=sorted(ARMS))
    parser.add_argument("--preset", default="narrow")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of a 1-rank run (spawned ranks set their own); 1 keeps a shared machine's noise down.")
    parser.add_argument("--before", type=Path, help="trees: the other checkout (its h3core and h3cli are imported from it).")
    parser.add_argument("generate_args", nargs="*", help="More h3 generate arguments (after --).")
    args = parser.parse_args()
    arms = ARMS[args.compare] or tree_arms(args.before)
    base = ["--preset", args.preset, "--steps", str(args.steps), "--device", "cpu", *args.generate_args]
    runs: dict[str, list[float]] = {label: [] for label, _, _ in arms}
    with tempfile.TemporaryDirectory() as out, tempfile.TemporaryDirectory() as cwd:
        for i in range(args.repeat):
            order = arms if i % 2 == 0 else arms[::-1]
            for label, extra, env in order:
                runs[label].append(one_run(base + extra, {"OMP_NUM_THREADS": str(args.threads), **env}, out, cwd))
    medians = {label: statistics.median(times) for label, times in runs.items()}
    reference = arms[0][0]
    title = f"h3 generate {' '.join(base)} · OMP_NUM_THREADS={args.threads} · {args.compare} · median of {args.repeat} runs, alternating"
    table = Table(title=title, title_justify="left")
    for column in ("arm", "median step s", "runs (median step each)", f"vs {reference}"):
        table.add_column(column)
    for label, times in runs.items():
        table.add_row(label, f"{medians[label]:.3f}", " ".join(f"{t:.3f}" for t in times), f"{medians[label] / medians[reference]:.3f}x")
    Console(width=200).print(table)


if __name__ == "__main__":
    main()
