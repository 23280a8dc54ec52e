#!/usr/bin/env python3
"""What `h3 generate --prompts` saves, measured side by side in one run.

(a) `wall`: N prompts in one `h3 generate --prompts FILE` command against N separate `h3 generate
    --prompt` commands (each a fresh process, as a user would run them), at each rank count; the
    two arms alternate (batch, separate, separate, batch, ...) so that drift on a shared machine
    hits both alike; median wall time of each arm over `--repeat` runs, and the ratio.
(b) `load`: the denoiser load each prompt of a batch pays, read from batch.json: the first prompt
    loads (weights read, parallelized), later prompts pay 0 (the rank process holds the pipeline).
    Sampling is cut to 1 step at the smallest size the preset takes, so the load is what shows.

    python scripts/bench_batch.py wall --preset tiny --prompts 8 --counts 1,2 --repeat 3
    python scripts/bench_batch.py load --preset h3-2blocks --prompts 3 --repeat 3
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

from rich.console import Console
from rich.table import Table

PROMPTS = ["a red fox running through fresh snow", "an owl at night", "rain on a tin roof", "a lighthouse in a storm",
           "a city street at dawn", "waves on black sand", "a train crossing a bridge", "a campfire under stars"]


def h3(args: list[str]) -> float:
    """Wall seconds of one `h3 ...` process (exit 0 required)."""
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "h3cli.main", *args], capture_output=True, text=True, env=os.environ.copy())
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        sys.exit(f"h3 {' '.join(args)} failed: {proc.stderr.strip()}")
    return seconds


def prompts_file(folder: Path, n: int) -> Path:
    path = folder / "prompts.txt"
    path.write_text("\n".join((PROMPTS * (n // len(PROMPTS) + 1))[:n]) + "\n")
    return path


def wall(opts: argparse.Namespace) -> None:
    table = Table(title=f"{opts.prompts} prompts, preset {opts.preset}, {opts.steps} steps: wall seconds, median of {opts.repeat} (alternating)")
    for col in ("ranks", "one command (--prompts)", f"{opts.prompts} commands", "ratio", "runs (batch | separate)"):
        table.add_column(col)
    common = ["--preset", opts.preset, "--steps", str(opts.steps), "--no-save-latents"]
    with tempfile.TemporaryDirectory() as tmp:
        file = prompts_file(Path(tmp), opts.prompts)
        texts = file.read_text().splitlines()
        for count in opts.counts:
            batch, separate, n = [], [], 0

            def one_batch() -> None:
                batch.append(h3(["generate", "-n", str(count), "--prompts", str(file), "-o", f"{tmp}/b{count}-{len(batch)}", *common]))

            def each() -> None:
                start = time.perf_counter()
                for i, text in enumerate(texts):
                    h3(["generate", "-n", str(count), "--prompt", text, "-o", f"{tmp}/s{count}-{len(separate)}-{i}", *common])
                separate.append(time.perf_counter() - start)

            for i in range(opts.repeat):
                for arm in ((one_batch, each) if i % 2 == 0 else (each, one_batch)):
                    arm()
            b, s = statistics.median(batch), statistics.median(separate)
            table.add_row(str(count), f"{b:.1f}", f"{s:.1f}", f"{s / b:.2f}x", f"{[round(x, 1) for x in batch]} | {[round(x, 1) for x in separate]}")
    Console().print(table)


def load(opts: argparse.Namespace) -> None:
    table = Table(title=f"denoiser load per prompt of a batch, preset {opts.preset}, {opts.prompts} prompts, 1 step, 32x32x1")
    for col in ("run", "first prompt (s)", "later prompts (s)", "text encoder, once (s)"):
        table.add_column(col)
    firsts = []
    with tempfile.TemporaryDirectory() as tmp:
        file = prompts_file(Path(tmp), opts.prompts)
        for i in range(opts.repeat):
            out = Path(tmp) / f"load{i}"
            h3(["generate", "--prompts", str(file), "--preset", opts.preset, "--steps", "1", "--width", "32", "--height", "32",
                "--frames", "1", "--no-save-latents", "-o", str(out)])
            summary = json.loads((out / "batch.json").read_text())
            loads = [p["load_seconds"] for p in summary["prompts"]]
            firsts.append(loads[0])
            table.add_row(str(i + 1), f"{loads[0]:.3f}", ", ".join(f"{x:.3f}" for x in loads[1:]), f"{summary['text_encoder_seconds']:.3f}")
    table.add_row("median", f"{statistics.median(firsts):.3f}", "", "")
    Console().print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["wall", "load"])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--counts", default="1,2", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--repeat", type=int, default=3)
    opts = parser.parse_args()
    (wall if opts.what == "wall" else load)(opts)


if __name__ == "__main__":
    main()
