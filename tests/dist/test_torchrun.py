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
    # latents only: the decode under torchrun is the test above's; here what is shared out is the prompts
    args = ["generate", "ulysses", "--preset", "tiny", "--steps", "2", "--device", "cpu", "--no-decode", "--prompts", str(prompts)]
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


def _agents_each(commands: list[list[str]], tmp_path: Path) -> list[subprocess.Popen]:
    """One torchrun agent per command (each "machine" gives its own command line, as on two pods)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    endpoint = f"127.0.0.1:{_free_port()}"
    launch = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(len(commands)), "--nproc-per-node", "1",
              "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", "h3-test", "-m", "h3cli.main"]
    logs = [open(tmp_path / f"agent{n}.log", "w+") for n in range(len(commands))]
    return [subprocess.Popen([*launch, *args], stdout=log, stderr=subprocess.STDOUT, text=True, env={**env, "OMP_NUM_THREADS": "1"})
            for log, args in zip(logs, commands)]


def test_ranks_whose_prompt_files_differ_refuse_in_one_line_and_write_nothing(tmp_path):
    """Two machines whose copies of the prompt file differ in one seed: every rank refuses, naming the
    rank that differs, before anything runs or is written (rank 0 used to write a report of one
    seed over latents made from both)."""
    files = []
    for n, seed in enumerate((1, 2)):
        path = tmp_path / f"node{n}" / "prompts.jsonl"
        path.parent.mkdir()
        path.write_text(f'{{"prompt": "a red fox", "seed": 3}}\n{{"prompt": "an owl", "seed": {seed}}}\n')
        files.append(path)
    base = ["generate", "ulysses", "--preset", "tiny", "--steps", "2", "--device", "cpu", "--replicas", "2", "--output", str(tmp_path / "out")]
    agents = _agents_each([[*base, "--prompts", str(path)] for path in files], tmp_path)
    codes = [agent.wait(timeout=240) for agent in agents]
    logs = [(tmp_path / f"agent{n}.log").read_text() for n in range(2)]
    assert all(code != 0 for code in codes), logs
    for log in logs:
        lines = [line for line in log.splitlines() if line.startswith("error: under torchrun every rank must resolve the same batch")]
        assert len(lines) == 1 and "rank 1 resolved another one than rank 0" in lines[0], log
        assert "Traceback" not in log.split("error: under torchrun")[0].split("\n")[-1]
    assert not (tmp_path / "out").exists()


def test_ranks_whose_flags_differ_refuse_a_single_run_too(tmp_path):
    base = ["generate", "ulysses", "--preset", "tiny", "--steps", "2", "--device", "cpu", "--output", str(tmp_path / "out")]
    agents = _agents_each([[*base, "--seed", "1"], [*base, "--seed", "2"]], tmp_path)
    codes = [agent.wait(timeout=240) for agent in agents]
    logs = [(tmp_path / f"agent{n}.log").read_text() for n in range(2)]
    assert all(code != 0 for code in codes), logs
    assert all("error: under torchrun every rank must resolve the same request" in log for log in logs), logs
    assert not (tmp_path / "out").exists()


def test_serve_across_two_torchrun_agents_runs_a_job_on_each_replica_group(tmp_path):
    """`h3 serve --replicas 2` over two agents (one group per "machine"): global rank 0 serves on
    loopback, each group takes a job of the same round (the other machine's group reports its steps
    through the store), both complete; SIGTERM to the agents ends every rank."""
    import signal
    import time
    import uuid

    from commands import http, no_survivors

    marker = f"H3_TEST_MARKER_{uuid.uuid4().hex}"
    port = _free_port()
    args = ["serve", "ulysses", "--replicas", "2", "--port", str(port), "--state-dir", str(tmp_path / "state"), "--device", "cpu",
            "--width", "64", "--height", "64", "--frames", "22", "--steps", "3"]
    os.environ[marker] = "1"
    try:
        agents = _agents(2, args, tmp_path)
    finally:
        del os.environ[marker]
    url = f"http://127.0.0.1:{port}"
    logs = lambda: [(tmp_path / f"agent{n}.log").read_text() for n in range(2)]  # noqa: E731
    try:
        deadline = time.monotonic() + 300
        while True:
            assert all(a.poll() is None for a in agents) and time.monotonic() < deadline, logs()
            try:
                if http("GET", f"{url}/health")[1]["status"] == "ok":
                    break
            except OSError:
                pass
            time.sleep(0.5)
        # Rounds claim what is queued when they start: a job alone in the queue runs alone. So a first job
        # holds the ranks while the two under test are queued, and the next round claims both at once.
        opener = http("POST", f"{url}/v1/videos", {"prompt": "a fox opens", "steps": 12})[1]["id"]
        while http("GET", f"{url}/v1/videos/{opener}")[1]["status"] == "queued":
            assert time.monotonic() < deadline, logs()
            time.sleep(0.05)
        ids = [http("POST", f"{url}/v1/videos", {"prompt": f"a fox {n}", "steps": 12})[1]["id"] for n in range(2)]
        while True:
            jobs = [http("GET", f"{url}/v1/videos/{i}")[1] for i in ids]
            if all(j["status"] in ("completed", "failed") for j in jobs):
                break
            assert time.monotonic() < deadline + 300, (jobs, logs())
            time.sleep(0.5)
        assert [j["status"] for j in jobs] == ["completed", "completed"], jobs
        assert sorted(j["replica"] for j in jobs) == [0, 1]  # one job per group, in one round
        assert all(http("GET", f"{url}/v1/videos/{i}/content")[0] == 200 for i in ids)
        for i in ids:  # each job decoded on both ranks (the World's), not on the server's rank alone
            decode = json.loads((tmp_path / "state" / "jobs" / i / "report.json").read_text())["decode"]
            assert decode["ranks"] == 2 and len(decode["units_per_rank"]) == 2, decode
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.send_signal(signal.SIGTERM)
        codes = [agent.wait(timeout=120) for agent in agents]
    assert all(code != 0 for code in codes), logs()  # stopped, not finished
    assert no_survivors(marker, seconds=30)
