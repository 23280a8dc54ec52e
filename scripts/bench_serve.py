#!/usr/bin/env python3
"""What `h3 serve` saves, measured side by side in one run.

Arm A: one `h3 serve` process (started, loaded, N jobs submitted over HTTP on 127.0.0.1, polled to
completion, stopped with SIGTERM). Arm B: the same N prompts (same seeds and flags) as N separate
`h3 generate` commands, one after the other, as a user without a server runs them (each on one
replica group's ranks: COUNT / REPLICAS). The arms alternate (A B B A A B ...) so that drift on a
shared machine hits both alike; each figure is the median over `--repeat` runs of its arm.

Printed: the wall time of each arm (A from the server's start, so its one load counts) and their
ratio; per job of A, from SQLite: the server's overhead from the moment a group took the job to its
first step (text encode, round set-up) next to its denoise and decode seconds; and the most jobs
that were running at once (2 with `--replicas 2`: two groups, two jobs).

    python scripts/bench_serve.py --jobs 4 --repeat 3
    python scripts/bench_serve.py --jobs 4 --repeat 3 --gpus 2 --replicas 2
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

PROMPTS = ["a red fox running through fresh snow", "an owl at night", "rain on a tin roof", "a lighthouse in a storm",
           "a city street at dawn", "waves on black sand", "a train crossing a bridge", "a campfire under stars"]


def _call(method: str, url: str, body: dict | None = None) -> dict:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, method=method, headers={"content-type": "application/json"} if data else {})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


def run_server(opts: argparse.Namespace, folder: Path) -> dict:
    """Arm A: wall seconds from the server's start to its last job done, and each job's row."""
    state = folder / "state"
    started = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "h3cli.main", "serve", "--port", "0", "--state-dir", str(state), *opts.common,
                             "--gpus", str(opts.gpus), "--replicas", str(opts.replicas)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "COLUMNS": "300"}, start_new_session=True)
    try:
        first = proc.stdout.readline()  # type: ignore[union-attr]
        if "http://" not in first:
            sys.exit(f"h3 serve did not start: {first} {proc.stderr.read() if proc.stderr else ''}")  # type: ignore[union-attr]
        url = "http://" + first.split("http://", 1)[1].split("/", 1)[0]
        deadline = time.monotonic() + opts.timeout
        while True:
            try:
                if _call("GET", f"{url}/health")["status"] == "ok":
                    break
            except OSError:
                pass
            if time.monotonic() > deadline or proc.poll() is not None:
                sys.exit("h3 serve did not become ready")
            time.sleep(0.1)
        ids = [_call("POST", f"{url}/v1/videos", {"prompt": p, "seed": i})["id"] for i, p in enumerate(opts.prompts)]
        while not all(_call("GET", f"{url}/v1/videos/{i}")["status"] in ("completed", "failed") for i in ids):
            if time.monotonic() > deadline:
                sys.exit("the server's jobs did not finish in time")
            time.sleep(0.1)
        seconds = time.perf_counter() - started
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=120)
    with sqlite3.connect(state / "jobs.sqlite3") as db:
        db.row_factory = sqlite3.Row
        rows = [dict(r) for r in db.execute("SELECT * FROM jobs ORDER BY seq")]
    if any(r["status"] != "completed" for r in rows):
        sys.exit(f"a server job failed: {[r['error_message'] for r in rows if r['status'] != 'completed']}")
    return {"seconds": seconds, "rows": rows}


def run_commands(opts: argparse.Namespace, folder: Path) -> float:
    """Arm B: N `h3 generate` commands, one after the other, on one group's ranks each."""
    started = time.perf_counter()
    for i, prompt in enumerate(opts.prompts):
        proc = subprocess.run([sys.executable, "-m", "h3cli.main", "generate", "--prompt", prompt, "--seed", str(i), *opts.common,
                               "--gpus", str(opts.gpus // opts.replicas), "-o", str(folder / f"cmd{i}")], capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"h3 generate failed: {proc.stderr.strip()}")
    return time.perf_counter() - started


def most_at_once(rows: list[dict]) -> int:
    """The most jobs that were running at the same moment (claimed, not yet completed)."""
    edges = sorted([(r["claimed_at"], 1) for r in rows] + [(r["completed_at"], -1) for r in rows])
    running = best = 0
    for _, step in edges:
        running += step
        best = max(best, running)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--gpus", type=int, default=1, help="The server's ranks (each separate command gets gpus / replicas).")
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--size", default="64x64")
    parser.add_argument("--frames", type=int, default=22)
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--json", type=Path, default=None, help="Also write every run's figures here.")
    opts = parser.parse_args()
    width, height = opts.size.split("x")
    opts.prompts = (PROMPTS * (opts.jobs // len(PROMPTS) + 1))[: opts.jobs]
    opts.common = ["--preset", opts.preset, "--steps", str(opts.steps), "--width", width, "--height", height, "--frames", str(opts.frames),
                   "--no-save-latents", "--device", "cpu"]
    servers, commands = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for n in range(opts.repeat):
            order = ("server", "commands") if n % 2 == 0 else ("commands", "server")
            for arm in order:
                folder = Path(tmp) / f"{arm}{n}"
                folder.mkdir()
                if arm == "server":
                    servers.append(run_server(opts, folder))
                else:
                    commands.append(run_commands(opts, folder))
                print(f"run {n + 1}/{opts.repeat} {arm}: {servers[-1]['seconds'] if arm == 'server' else commands[-1]:.2f}s", file=sys.stderr)
    rows = [r for s in servers for r in s["rows"]]
    overhead = [r["first_step_at"] - r["claimed_at"] for r in rows if r["first_step_at"]]
    server_s, commands_s = statistics.median(s["seconds"] for s in servers), statistics.median(commands)
    figures = {
        "jobs": opts.jobs, "repeat": opts.repeat, "gpus": opts.gpus, "replicas": opts.replicas, "flags": opts.common,
        "server_wall_s": server_s, "commands_wall_s": commands_s, "ratio_commands_over_server": commands_s / server_s,
        "overhead_claim_to_first_step_s": statistics.median(overhead) if overhead else None,
        "denoise_s": statistics.median(r["denoise_seconds"] for r in rows), "decode_s": statistics.median(r["decode_seconds"] for r in rows),
        "most_jobs_at_once": max(most_at_once(s["rows"]) for s in servers),
        "runs": {"server_wall_s": [s["seconds"] for s in servers], "commands_wall_s": commands},
    }
    print(f"h3 serve vs {opts.jobs} separate `h3 generate` commands · {opts.gpus} rank(s), {opts.replicas} replica group(s) · "
          f"{' '.join(opts.common)} · median of {opts.repeat}, alternating")
    print(f"  wall: server {server_s:.2f}s (its start and load included) · commands {commands_s:.2f}s · ratio {figures['ratio_commands_over_server']:.2f}x")
    print(f"  per job on the server (median of {len(rows)}): claim -> first step {figures['overhead_claim_to_first_step_s'] or float('nan'):.3f}s · "
          f"denoise {figures['denoise_s']:.3f}s · decode {figures['decode_s']:.3f}s")
    print(f"  most jobs running at once: {figures['most_jobs_at_once']}")
    if opts.json is not None:
        opts.json.write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
