"""`World`: the one way h3 runs code on several ranks (DESIGN.md §6).

`World(n, device)`:

- `n == 1`: no process and no process group; `run` calls the task in this process with
  `group=None`, which every collective treats as the identity. This path costs nothing.
- under `torchrun` (RANK, WORLD_SIZE and LOCAL_RANK set: `settings.torchrun_env`, the one
  definition): nothing is spawned; this process joins the existing group (env:// rendezvous,
  bounded by `H3_RANK_TIMEOUT`, so a stale torchrun environment is one line, not a hang) and runs
  the task itself. Results are gathered to rank 0; see `World.run`. A failing rank raises here;
  torchrun's agent then stops the others. Each process resolved its own inputs: `agree` checks
  that every rank resolved the same run before it starts.
- otherwise: `n` worker processes (`h3core.runtime.worker`) are spawned once (spawn context),
  rendezvous through a TCP store that this process hosts on a free port, and form a Gloo (CPU) or
  NCCL (CUDA, rank `r` on `cuda:r`) group with a timeout. Each `run` sends them one task; they stay
  up for the next.

Faults: when a rank raises or its process dies (also SIGKILL or `os._exit`), `run` stops every
worker within seconds (SIGTERM, then SIGKILL), reaps them, and raises the failing rank's error:
the rank's own `H3Error` subclass (so a `ConfigError` still exits 2), else `RankFailure(rank,
"<ExcType>: message")`, with the rank's traceback chained as the cause (shown with H3_DEBUG=1).
A faulted World is closed. Leaving the `with` block always reaps every worker, also on
KeyboardInterrupt; workers ignore SIGINT so that only this process handles Ctrl-C, and a worker
whose parent disappears exits by itself.

Stalls (`h3core.runtime.liveness`): every worker stamps a shared heartbeat each second; when a started
rank has shown no sign of life for `H3_RANK_TIMEOUT` seconds (default 60: `kill -STOP`, a frozen
process) the run is stopped like a failed one, naming the rank and its process state. A rank that
runs but waits still stamps; the collective timeout (`H3_COLLECTIVE_TIMEOUT`, default 600 s)
bounds that wait.

Workers never write to the terminal: their stdout and stderr go to /dev/null unless H3_DEBUG=1.
Rank 0 reports progress through `RankContext.report`, which reaches `World.on_progress` here.
"""

from __future__ import annotations

import os
import pickle
import signal
import time
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING, Any, Callable, TypeVar

from h3core import settings
from h3core.errors import ConfigError, H3Error, RankFailure
from h3core.runtime import cpu_memory
from h3core.runtime.context import RankContext, leave_group
from h3core.runtime.device import check_world_size_fits, cpu_threads_per_rank, rank_device, resolve_device, visible_gpu_count
from h3core.runtime.liveness import HEARTBEAT_S, Watch, new_heartbeat
from h3core.runtime.messages import RankError, describe_exit, to_cpu
from h3core.runtime.rendezvous import torchrun_store
from h3core.runtime.worker import WorkerSpec, init_group, worker_main

if TYPE_CHECKING:
    from multiprocessing.process import BaseProcess

R = TypeVar("R")

_FAULT_GRACE_S = 0.3  # after a first failure, how long to listen for its root cause (a dead rank)
_TERMINATE_GRACE_S = 3.0  # SIGTERM -> SIGKILL
_STOP_GRACE_S = 10.0  # a clean stop: time for workers to leave their process group


@dataclass
class _Worker:
    rank: int
    process: "BaseProcess"
    conn: Connection
    heartbeat: Any  # shared double: the worker's last sign of life (`h3core.runtime.liveness`)


class World:
    """`world_size` ranks that run many tasks; see the module docstring. Use as a context manager."""

    def __init__(
        self,
        world_size: int,
        device: str = "cpu",
        timeout_s: float | None = None,
        on_progress: Callable[[Any], None] | None = None,
        rank_timeout_s: float | None = None,
    ):
        """Start the ranks. `device`: 'cpu', 'cuda' or 'auto'; `timeout_s`: start-up and collective
        timeout (default `H3_COLLECTIVE_TIMEOUT`, else 600 s); `on_progress`: called here with every
        message rank 0 sends via `ctx.report`; `rank_timeout_s`: how long a rank may show no sign
        of life, and how long torchrun's ranks have to meet (default `H3_RANK_TIMEOUT`, else 60 s)."""
        if world_size < 1:
            raise ConfigError(f"world size must be at least 1, got {world_size}")
        self.world_size = world_size
        self.device_type = resolve_device(device)
        if self.device_type == "cpu":
            cpu_memory.apply()  # this process may run a rank itself; spawned workers apply it too
        self.timeout_s = timeout_s if timeout_s is not None else settings.collective_timeout_s()
        self.rank_timeout_s = rank_timeout_s if rank_timeout_s is not None else settings.rank_timeout_s()
        self.on_progress = on_progress
        self.backend = "none"
        self._workers: list[_Worker] = []
        self._local: RankContext | None = None
        self._joined_torchrun = False
        self._store: Any = None
        self._busy = False  # a task is in flight: workers would not read a clean "stop"
        self._watch = Watch(self.rank_timeout_s)
        self._closed = False
        launched = settings.torchrun_env()
        if launched is not None:
            self._join_torchrun(launched)
        else:
            check_world_size_fits(world_size, self.device_type)
            if world_size == 1:
                from torch.distributed import HashStore

                self._local = RankContext(0, 1, 0, rank_device(self.device_type, 0), None, "none", self._progress, store=HashStore())
            else:
                self._spawn()

    # -- public ----------------------------------------------------------------------------------------

    @property
    def is_main(self) -> bool:
        """True in the process that should render results and write reports (rank 0 / the parent)."""
        return self._local is None or self._local.rank == 0

    @property
    def pids(self) -> list[int]:
        """Process ids of the spawned workers (empty when nothing was spawned)."""
        return [w.process.pid for w in self._workers if w.process.pid is not None]

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def store(self) -> Any:
        """The key-value store every rank of this World reaches (`RankContext.store`), from this
        process: the TCP store it hosts for spawned ranks, torchrun's, or the in-process one at world
        size 1 (None only when torchrun's group was made before h3 joined it)."""
        return self._store if self._workers else (self._local.store if self._local is not None else None)

    def run(self, fn: Callable[..., R], *args: Any, **kwargs: Any) -> list[R]:
        """`fn(ctx, *args, **kwargs)` on every rank; each rank's result, in rank order, tensors on the CPU.

        `fn` must be a module-level function and `args`/`kwargs` picklable (they are sent to the
        workers; at world size 1 they are passed as they are). Under torchrun, rank 0 receives
        every rank's result and every other rank a list holding only its own (None elsewhere).
        """
        if self._closed:
            raise RuntimeError("this World is closed (after a fault or close()); start a new World")
        if self._local is not None:
            return self._run_here(fn, args, kwargs)
        return self._run_spawned(fn, args, kwargs)

    def agree(self, digest: str, what: str) -> None:
        """Under torchrun, where every process resolves its own copy of the inputs (flags, files,
        weights), check that every rank resolved the same `what`: each rank's `digest` of it goes to
        every rank, and where any differs from rank 0's, every rank raises the same one-line
        `ConfigError` naming them, before any of them runs or writes a thing. Spawned ranks and a
        single process run what this process resolved: nothing to check.
        """
        ctx = self._local
        if ctx is None or ctx.group is None or ctx.world_size == 1:
            return
        import torch.distributed as dist

        digests: list[str | None] = [None] * ctx.world_size
        dist.all_gather_object(digests, digest, group=ctx.group)
        differ = [rank for rank, theirs in enumerate(digests) if theirs != digests[0]]
        if differ:
            shown = ", ".join(map(str, differ[:8])) + (", ..." if len(differ) > 8 else "")
            raise ConfigError(
                f"under torchrun every rank must resolve the same {what}, but rank{'s' if len(differ) > 1 else ''} {shown} "
                f"resolved another one than rank 0 (their flags, prompt file, weights or H3_* settings differ): "
                "give every machine the same command, files and settings"
            )

    def close(self) -> None:
        """Stop and reap every worker: a clean stop when they are idle, else signals. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._workers:
            _stop_workers(self._workers, clean=not self._busy)
        if self._joined_torchrun:
            leave_group(self._local)
        elif self._local is not None:
            self._local.leave()  # world size 1: what the rank held ends with its World
        self._store = None

    def __enter__(self) -> "World":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            try:
                self.close()
            except Exception:
                pass  # interpreter shutdown; multiprocessing's exit hook still ends daemonic workers

    # -- world size 1 and torchrun: the task runs in this process -------------------------------------------

    def _progress(self, message: Any) -> None:
        if self.on_progress is not None:
            self.on_progress(message)

    def _run_here(self, fn: Callable[..., R], args: tuple, kwargs: dict) -> list[R]:
        ctx = self._local
        assert ctx is not None
        try:
            result = to_cpu(fn(ctx, *args, **kwargs))
        except H3Error:
            raise
        except Exception as exc:
            raise RankFailure(ctx.rank, f"{type(exc).__name__}: {exc}") from exc
        if not self._joined_torchrun or ctx.world_size == 1:
            return [result]
        return _gather_to_main(ctx, result)

    def _join_torchrun(self, launched: settings.TorchrunEnv) -> None:
        import torch.distributed as dist

        env_world, rank, local_rank = launched.world_size, launched.rank, launched.local_rank
        if env_world != self.world_size:
            raise ConfigError(
                f"torchrun started {env_world} processes but {self.world_size} ranks were asked for; "
                f"pass {env_world} or leave the count out"
            )
        if self.device_type == "cuda" and local_rank >= visible_gpu_count():
            raise ConfigError(f"LOCAL_RANK {local_rank} has no GPU: only {visible_gpu_count()} are visible on this machine")
        device = rank_device(self.device_type, local_rank)
        store = None
        if dist.is_initialized():
            self.backend = str(dist.get_backend())
        else:
            timeout = timedelta(seconds=self.timeout_s)
            store = torchrun_store(launched, self.rank_timeout_s, timeout)
            self.backend = init_group(self.device_type, device, store, rank, env_world, timeout)
            self._joined_torchrun = True
            if self.device_type == "cpu":  # joined: this process is a rank of the launch from now on
                _share_cores(launched.local_world_size)
        progress = self._progress if rank == 0 else None
        self._local = RankContext(rank, env_world, local_rank, device, dist.group.WORLD, self.backend, progress, store=store)

    # -- spawned workers ----------------------------------------------------------------------------

    def _spawn(self) -> None:
        import multiprocessing

        import torch.distributed as dist

        # This process hosts the rendezvous store on a free port: no port to pick, none to collide.
        timeout = timedelta(seconds=self.timeout_s)
        self._store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timeout, wait_for_workers=False)
        context = multiprocessing.get_context("spawn")
        debug = settings.debug()
        self._busy = True
        try:
            for rank in range(self.world_size):
                spec = WorkerSpec(rank, self.world_size, self.device_type, self._store.port, self.timeout_s, os.getpid(), debug)
                parent_end, child_end = context.Pipe(duplex=True)
                heartbeat = new_heartbeat(context)
                process = context.Process(target=worker_main, args=(spec, child_end, heartbeat), name=f"h3-rank{rank}", daemon=True)
                process.start()
                child_end.close()
                self._workers.append(_Worker(rank, process, parent_end, heartbeat))
            self.backend = "nccl" if self.device_type == "cuda" else "gloo"
            self._collect("ready", deadline=time.monotonic() + self.timeout_s)
        except BaseException:
            self.close()
            raise
        self._watch.started = True
        self._busy = False

    def _run_spawned(self, fn: Callable[..., R], args: tuple, kwargs: dict) -> list[R]:
        try:
            payload = pickle.dumps((fn, args, kwargs))
        except Exception as err:
            raise TypeError(
                f"World.run needs a module-level function and picklable arguments; {fn!r} cannot be sent ({err})"
            ) from err
        self._busy = True
        try:
            for worker in self._workers:
                try:
                    worker.conn.send(("run", payload))
                except OSError:
                    self._fault(None, suspect=worker.rank)  # it died since the last task
            answers = self._collect("ok", deadline=None)
        except BaseException:
            self.close()
            raise
        self._busy = False
        return [pickle.loads(answers[w.rank]) for w in self._workers]

    def _collect(self, tag: str, deadline: float | None) -> dict[int, Any]:
        """Wait until every worker answered `tag`, forwarding progress; a fault (also a rank that
        stopped showing signs of life) raises."""
        answers: dict[int, Any] = {}
        by_conn = {w.conn: w for w in self._workers}
        sentinels = {w.process.sentinel for w in self._workers}
        while len(answers) < len(self._workers):
            timeout = HEARTBEAT_S if deadline is None else min(HEARTBEAT_S, max(0.0, deadline - time.monotonic()))
            ready = wait([w.conn for w in self._workers if w.rank not in answers] + list(sentinels), timeout)
            self._check_signs_of_life()
            if not ready:
                if deadline is not None and time.monotonic() >= deadline:
                    self.close()
                    raise H3Error(
                        f"the {self.world_size} ranks did not start within {self.timeout_s:.0f}s; "
                        f"rerun with {settings.DEBUG}=1 to see their output"
                    )
                continue
            for handle in ready:
                if handle in by_conn:
                    self._receive(by_conn[handle], tag, answers)
            if any(handle in sentinels for handle in ready):
                self._fault(None)  # a worker died, even one that had answered: the World is unusable
        return answers

    def _check_signs_of_life(self) -> None:
        """Stop the run when a started rank has shown no sign of life for `rank_timeout_s`."""
        silent = self._watch.silent({w.rank: (w.process.pid, w.heartbeat) for w in self._workers if w.process.exitcode is None})
        if silent is not None:
            self.close()
            rank, what = silent
            raise RankFailure(rank, f"{what}; the run was stopped. {settings.RANK_TIMEOUT} (now {self.rank_timeout_s:g} s) sets how long h3 waits for a rank")

    def _receive(self, worker: _Worker, tag: str, answers: dict[int, Any]) -> None:
        try:
            kind, body = worker.conn.recv()
        except (EOFError, OSError):
            return  # it died; its sentinel reports that
        if kind == "progress":
            self._progress(pickle.loads(body))
        elif kind == "error":
            self._fault(body)
        elif kind == tag:
            answers[worker.rank] = body

    def _fault(self, first_error: RankError | None, suspect: int | None = None) -> None:
        """Find the root cause, stop every worker, raise it.

        A rank that died beats the errors its peers raised after it ('connection closed'), so
        after the first sign of trouble we listen a moment longer; among errors the first wins.
        `suspect`: the rank whose pipe broke, blamed when nothing more precise turns up.
        """
        errors = [first_error] if first_error is not None else []
        grace_end = time.monotonic() + _FAULT_GRACE_S
        while time.monotonic() < grace_end and not any(w.process.exitcode is not None for w in self._workers):
            errors.extend(_drain_errors(self._workers))
            time.sleep(0.02)
        dead = [w for w in self._workers if w.process.exitcode is not None]
        exitcodes = {w.rank: w.process.exitcode for w in dead}
        self.close()
        if dead:
            rank = min(exitcodes)
            raise RankFailure(rank, describe_exit(exitcodes[rank]))
        if errors:
            raise errors[0].to_exception(self.world_size)
        raise RankFailure(suspect if suspect is not None else -1, "lost contact with the process")


def _share_cores(ranks_here: int) -> None:
    """torchrun on CPUs: this machine's ranks share its cores, as spawned ranks do (unless the user
    set OMP_NUM_THREADS, which torch already applied). Kernels block by thread count, so this also
    makes a torchrun run compute what the same count of spawned ranks computes, bit for bit."""
    import torch

    if not os.environ.get("OMP_NUM_THREADS"):
        torch.set_num_threads(cpu_threads_per_rank(ranks_here))


def _drain_errors(workers: list[_Worker]) -> list[RankError]:
    errors = []
    for worker in workers:
        try:
            while worker.conn.poll():
                kind, body = worker.conn.recv()
                if kind == "error":
                    errors.append(body)
        except (EOFError, OSError):
            continue
    return errors


def _gather_to_main(ctx: RankContext, result: Any) -> list:
    """torchrun: every result to rank 0; the other ranks keep only their own."""
    import torch.distributed as dist

    gathered: list | None = [None] * ctx.world_size if ctx.rank == 0 else None
    dist.gather_object(result, gathered, dst=0, group=ctx.group)
    if gathered is not None:
        return gathered
    mine: list = [None] * ctx.world_size
    mine[ctx.rank] = result
    return mine


def _stop_workers(workers: list[_Worker], clean: bool) -> None:
    """Idle workers are asked to leave their group and exit; the rest get SIGTERM, then SIGKILL."""
    if clean:
        for worker in workers:
            try:
                worker.conn.send(("stop", None))
            except OSError:
                pass
        _join_within(workers, _STOP_GRACE_S)
    for worker in workers:
        if worker.process.is_alive():
            worker.process.terminate()
            _continue(worker.process.pid)  # a stopped process acts on SIGTERM only once it runs again
    _join_within(workers, _TERMINATE_GRACE_S)
    for worker in workers:
        if worker.process.is_alive():
            worker.process.kill()
            worker.process.join()
        worker.conn.close()


def _join_within(workers: list[_Worker], seconds: float) -> None:
    """Wait for the workers to exit, `seconds` for all of them together."""
    deadline = time.monotonic() + seconds
    for worker in workers:
        worker.process.join(max(0.0, deadline - time.monotonic()))


def _continue(pid: int | None) -> None:
    if pid is not None:
        try:
            os.kill(pid, signal.SIGCONT)
        except OSError:
            pass
