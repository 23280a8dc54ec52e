"""Under torchrun, h3 joins the existing group instead of spawning (how it spans machines)."""

import json
import os
import subprocess
import sys


def test_bench_transport_under_torchrun_reports_once_from_rank_0():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "h3cli.main", "bench-transport", "--tokens", "67", "--heads", "5", "--head-dim", "16",
         "--iters", "2", "--warmup", "0", "--device", "cpu", "--json"],
        capture_output=True, text=True, env={**env, "OMP_NUM_THREADS": "1"}, timeout=180,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)  # exactly one JSON document: only rank 0 printed
    assert report["config"]["world_size"] == 2  # the count came from torchrun's WORLD_SIZE
    assert report["backend"] == "gloo" and report["identity_exact"]
    assert report["tokens_per_rank"] == [34, 33] and report["heads_per_rank"] == [3, 2]
