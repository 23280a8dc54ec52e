#!/usr/bin/env python3
"""`h3 bench-transport` from another checkout and from this one, alternating: h3 / wire before and after.

Each run is a fresh `h3 bench-transport N ... --json` process; the two trees alternate A, B, B, A, ...
per rank count so that drift on a shared machine hits both alike. Per run: h3's round trip, the wire,
their ratio, and the terms that differ (Ulysses' extra finish = finish_into_blocks - finish_one_rank,
head->seq). An arm's figure is the median over its runs; the spread is min-max.

    git worktree add ../h3-old <commit>
    python scripts/bench_transport_ab.py --before ../h3-old --counts 2,4,8 --repeat 5

Both trees run with this environment's installed dependencies, each imported through PYTHONPATH
(the processes start in a temporary folder, so neither tree's folder shadows the other).
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

HERE = Path(__file__).resolve().parent.parent
FIGURES = ("ratio", "round_trip_ms", "wire_ms", "extra_finish_ms", "head_to_seq_ms")


def one_run(tree: Path, count: int, args: argparse.Namespace, folder: str) -> dict[str, float]:
    """One `h3 bench-transport` process from `tree`: its figures, and the load average when it started."""
    command = [
        sys.executable, "-m", "h3cli.main", "bench-transport", str(count), "--tokens", str(args.tokens), "--skip-attention",
        "--iters", str(args.iters), "--warmup", str(args.warmup), "--device", "cpu", "--json",
    ]
    load = os.getloadavg()[0]
    proc = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(tree)}, cwd=folder)
    if proc.returncode != 0:
        sys.exit(f"h3 bench-transport {count} failed in {tree}: {proc.stderr.strip()}")
    report = json.loads(proc.stdout)
    phases = report["phases"]
    extra = phases["finish_into_blocks"]["median_s"] - phases["finish_one_rank"]["median_s"]  # each: median of the slowest rank
    return {
        "ratio": report["ratio"], "round_trip_ms": 1e3 * report["round_trip_s"], "wire_ms": 1e3 * report["wire_s"],
        "extra_finish_ms": 1e3 * extra, "head_to_seq_ms": 1e3 * phases["head_to_seq"]["median_s"], "load": load,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", type=Path, required=True, help="The other checkout (its h3core and h3cli are imported from it).")
    parser.add_argument("--counts", default="2,4,8")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--iters", type=int, default=9)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--json", type=Path, help="Also write every run's figures here.")
    args = parser.parse_args()
    if not (args.before / "h3core").is_dir():
        sys.exit(f"--before {args.before} is not a checkout of h3 (no h3core/); try: git worktree add ../h3-old HEAD~1")
    arms = {"before": args.before.resolve(), "after": HERE}
    runs: list[dict[str, float | int | str]] = []
    with tempfile.TemporaryDirectory() as folder:
        for count in (int(c) for c in args.counts.split(",")):
            for i in range(args.repeat):
                for arm in (("before", "after") if i % 2 == 0 else ("after", "before")):
                    runs.append({"ranks": count, "arm": arm, **one_run(arms[arm], count, args, folder)})
                    print(json.dumps(runs[-1]), file=sys.stderr, flush=True)
    if args.json:
        args.json.write_text(json.dumps(runs, indent=1))
    show(runs, args)


def show(runs: list[dict], args: argparse.Namespace) -> None:  # type: ignore[type-arg]
    table = Table(title=f"h3 bench-transport N --tokens {args.tokens} --skip-attention --iters {args.iters} --warmup {args.warmup}"
                  f" --device cpu · before = {args.before} · median (min-max) of {args.repeat} runs, alternating", title_justify="left")
    for column in ("ranks", "arm", *FIGURES, "load average"):
        table.add_column(column)
    for count in sorted({r["ranks"] for r in runs}):
        for arm in ("before", "after"):
            mine = [r for r in runs if r["ranks"] == count and r["arm"] == arm]
            cells = [_spread([r[f] for r in mine], 3 if f == "ratio" else 0) for f in FIGURES]
            table.add_row(str(count), arm, *cells, _spread([r["load"] for r in mine], 1, median=False))
    Console(width=200).print(table)


def _spread(values: list[float], digits: int, median: bool = True) -> str:
    low, high = f"{min(values):.{digits}f}", f"{max(values):.{digits}f}"
    return f"{statistics.median(values):.{digits}f} ({low}-{high})" if median else f"{low}-{high}"


if __name__ == "__main__":
    main()
