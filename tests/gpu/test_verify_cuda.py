"""`h3 verify` on CUDA: NCCL and bf16, counts above the visible GPUs skipped as 'needs N GPUs', the
one-rank identity (both modes bit-identical) always run. Skipped without CUDA."""

import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


def test_verify_on_cuda_uses_nccl_bf16_and_skips_what_does_not_fit(tmp_path):
    counts = [2, GPUS + 1] if GPUS >= 2 else [2]
    proc = subprocess.run(
        [sys.executable, "-m", "h3cli.main", "verify", "transport", "ragged", "tp", "parity", "backends",
         "--device", "cuda", "--counts", ",".join(map(str, counts)), "--steps", "2", "--json", "--output", str(tmp_path)],
        capture_output=True, text=True, env=os.environ, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["device"] == "cuda" and report["dtype"] == "bf16"
    rows = report["rows"]
    identity = next(r for r in rows if r["mode"] == "tensor = ulysses")
    assert identity["verdict"] == "pass" and identity["max_abs"] == 0.0
    for row in rows:
        if row["count"] > GPUS:
            assert row["verdict"] == "skip" and row["reason"] == f"needs {row['count']} GPUs, {GPUS} visible"
        elif row["count"] > 1:
            assert row["verdict"] == "pass" and row["backend"] == "nccl" and row["dtype"] == "bf16", row
    assert any(r["check"] == "backends" and r["mode"] == "math attention" and r["verdict"] == "pass" for r in rows)
