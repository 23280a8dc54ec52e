"""Under torchrun, h3 joins the existing group instead of spawning (how it spans machines)."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from h3core.runtime.device import cpu_threads
from tests.commands import run_main


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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _agents(nodes: int, args: list[str], tmp_path: Path) -> list[subprocess.Popen]:
    """`nodes` torchrun agents on this machine, as on `nodes` machines: c10d rendezvous on loopback,
    one process each (what `torchrun --nnodes N --nproc-per-node 8 ...` does on N pods)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    endpoint = f"127.0.0.1:{_free_port()}"
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes), "--nproc-per-node", "1",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", "h3-test", "-m", "h3cli.main", *args]
    logs = [open(tmp_path / f"agent{n}.log", "w+") for n in range(nodes)]
    # OMP_NUM_THREADS=1: the agents share this machine's cores as spawned ranks do (bitwise the same kernels)
    return [subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, text=True, env={**env, "OMP_NUM_THREADS": "1"}) for log in logs]


def test_generate_across_two_torchrun_agents_equals_the_spawned_ranks(tmp_path, capsys):
    """Multi-node: two agents (`--nnodes 2`, c10d rendezvous) form one 2-rank world; rank 0 writes
    the run, and its latents are bit for bit those of 2 spawned ranks."""
    args = ["generate", "ulysses", "--preset", "tiny", "--steps", "2", "--guidance", "3", "--device", "cpu"]
    agents = _agents(2, [*args, "--output", str(tmp_path / "torchrun")], tmp_path)
    codes = [agent.wait(timeout=240) for agent in agents]
    logs = [(tmp_path / f"agent{n}.log").read_text() for n in range(2)]
    assert codes == [0, 0], logs
    code, _, err = run_main(capsys, *args[:2], "2", *args[2:], "--output", str(tmp_path / "spawned"))
    assert code == 0, err
    ours, theirs = (load_file(tmp_path / name / "latents.safetensors") for name in ("torchrun", "spawned"))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    report = json.loads((tmp_path / "torchrun" / "report.json").read_text())
    assert report["world_size"] == 2 and [r["rank"] for r in report["ranks"]] == [0, 1]


def test_replica_groups_across_two_torchrun_agents_share_the_prompts_out(tmp_path, capsys):
    """`--replicas 2` over two agents (one group per "machine"): each prompt runs once, on one group;
    rank 0 writes every prompt's folder and batch.json; each prompt's latents are bit for bit that
    prompt on one rank in this process (at the agents' one thread)."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red fox in snow\na lighthouse at night\na cat on a piano\n")
    args = ["generate", "ulysses", "--preset", "tiny", "--steps", "2", "--device", "cpu", "--prompts", str(prompts)]
    agents = _agents(2, [*args, "--replicas", "2", "--output", str(tmp_path / "replicas")], tmp_path)
    codes = [agent.wait(timeout=240) for agent in agents]
    assert codes == [0, 0], [(tmp_path / f"agent{n}.log").read_text() for n in range(2)]
    with cpu_threads(1):
        code, _, err = run_main(capsys, *args[:2], "1", *args[2:], "--output", str(tmp_path / "one"))
    assert code == 0, err
    batch = json.loads((tmp_path / "replicas" / "batch.json").read_text())
    assert [(p["status"], p["replica"]) for p in batch["prompts"]] == [("ok", 0), ("ok", 1), ("ok", 0)]
    for p in batch["prompts"]:
        ours, alone = (load_file(tmp_path / run / p["folder"] / "latents.safetensors") for run in ("replicas", "one"))
        assert all(torch.equal(ours[k], alone[k]) for k in ours), p["folder"]
