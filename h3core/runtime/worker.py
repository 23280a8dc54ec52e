"""The spawned rank's side of a `World`: join the group, then run tasks until told to stop.

A worker ignores SIGINT (Ctrl-C is its parent's to handle), applies the CPU allocator policy
before its first large tensor, writes nothing to the terminal unless H3_DEBUG=1, stamps its
heartbeat from a thread (`h3core.runtime.liveness`) and exits by itself when its parent disappears.
"""

from __future__ import annotations

import os
import pickle
import signal
import sys
import threading
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from h3core.runtime import cpu_memory
from h3core.runtime.context import RankContext, leave_group
from h3core.runtime.device import cpu_threads_per_rank, nccl_environment, rank_device
from h3core.runtime.liveness import beat_while_parent_lives
from h3core.runtime.messages import RankError, to_cpu

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class WorkerSpec:
    rank: int
    world_size: int
    device_type: str
    store_port: int
    timeout_s: float
    parent_pid: int
    debug: bool


def worker_main(spec: WorkerSpec, conn: Connection, heartbeat: Any) -> None:
    """Entry point of a spawned rank: join the group, then run tasks until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    if spec.device_type == "cpu":
        cpu_memory.apply()  # before the first large tensor (h3core.runtime.cpu_memory)
    if not spec.debug:
        _silence_output()
    threading.Thread(target=beat_while_parent_lives, args=(spec.parent_pid, heartbeat), daemon=True).start()
    try:
        ctx = _join_spawned_group(spec, conn)
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the parent
        conn.send(("error", RankError.of(spec.rank, exc)))
        _wait_for_stop(conn)
        return
    conn.send(("ready", os.getpid()))
    _serve(ctx, conn)
    leave_group(ctx)
    # Nothing left to finalise; skipping interpreter teardown (torch's is slow) makes close() quick.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _silence_output() -> None:
    devnull = os.open(os.devnull, os.O_WRONLY)
    for fd in (1, 2):
        os.dup2(devnull, fd)
    os.close(devnull)


def _join_spawned_group(spec: WorkerSpec, conn: Connection) -> RankContext:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(cpu_threads_per_rank(spec.world_size))
    device = rank_device(spec.device_type, spec.rank)
    timeout = timedelta(seconds=spec.timeout_s)
    store = dist.TCPStore("127.0.0.1", spec.store_port, None, False, timeout=timeout)
    backend = init_group(spec.device_type, device, store, spec.rank, spec.world_size, timeout)
    progress = (lambda message: conn.send(("progress", pickle.dumps(message)))) if spec.rank == 0 else None
    return RankContext(spec.rank, spec.world_size, spec.rank, device, dist.group.WORLD, backend, progress, store=store)


def init_group(device_type: str, device: "torch.device", store: Any, rank: int, world_size: int, timeout: timedelta) -> str:
    """Gloo on the CPU; NCCL on CUDA bound to this rank's GPU, with fail-fast error handling.

    `store`: the rendezvous store (the parent's TCP store for spawned workers, torchrun's for a
    torchrun launch).
    """
    import torch
    import torch.distributed as dist

    rendezvous: dict[str, Any] = {"store": store}
    if device_type == "cuda":
        for name, value in nccl_environment(timeout.total_seconds()).items():
            os.environ.setdefault(name, value)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", rank=rank, world_size=world_size, timeout=timeout, device_id=device, **rendezvous)
        return "nccl"
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timeout, **rendezvous)
    return "gloo"


def _serve(ctx: RankContext, conn: Connection) -> None:
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return  # the parent is gone
        if message[0] != "run":
            return
        try:
            fn, args, kwargs = pickle.loads(message[1])
            payload = pickle.dumps(to_cpu(fn(ctx, *args, **kwargs)))
        except BaseException as exc:  # noqa: BLE001 - also SystemExit: the parent decides
            conn.send(("error", RankError.of(ctx.rank, exc)))
            _wait_for_stop(conn)  # peers may be blocked on us; the parent stops everyone
            return
        conn.send(("ok", payload))


def _wait_for_stop(conn: Connection) -> None:
    try:
        while conn.recv()[0] != "stop":
            pass
    except (EOFError, OSError):
        pass
