"""`serve(job)`: the one call behind `h3 serve`.

In the launching process (global rank 0 under torchrun):

1. checks before anything starts: a non-loopback address needs an API key (one line otherwise), the
   flags resolve as `h3 generate`'s, the state directory is taken and locked (a second server on the
   same directory is refused at once), the port is bound (a port in use is one line);
2. the queue is recovered (`JobQueue.recover`: interrupted jobs queued again, deleted jobs' files
   removed, stale staging gone), uvicorn serves the app on a thread (so that Ctrl-C and SIGTERM
   reach this, the main thread), the progress pump starts;
3. the engine runs here (`Engine.run`): it loads, then runs rounds until the server is stopped.

Ctrl-C / SIGTERM (raised here as `KeyboardInterrupt` / `Terminated`): the server takes no new job
(503), the World's ranks are stopped (every one, spawned or in this process), the running jobs go
back to the queue with nothing of them written (their staging is removed), the HTTP server closes,
the lock is released, and the command exits 130 / 143. A `kill -9` skips all that; the next start
recovers the same way from what SQLite and the state directory hold.

Under torchrun the other ranks run only the engine (`Engine.run`, following rank 0's orders).
"""

from __future__ import annotations

import ipaddress
import json
import shutil
import socket
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from uvicorn.protocols.http.h11_impl import H11Protocol

from h3core import settings
from h3core.errors import ConfigError, Interrupted
from h3core.reports.outputs import ResultsFolder
from h3core.reports.schema import Versions, timestamp
from h3core.serve.engine import Engine, ProgressPump, ServeJob, ServerState
from h3core.serve.inputs import Limits
from h3core.serve.queue import JobQueue

if TYPE_CHECKING:
    import uvicorn

INDEX = "serve.json"
Say = Callable[[str], None]


def check_binding(host: str, api_key: str | None) -> None:
    """Loopback, or an API key: a server reachable from other machines is never open."""
    if api_key is not None and len(api_key) < 16:
        raise ConfigError("--api-key / H3_API_KEY is shorter than 16 characters; use a long random key, e.g. `python -c 'import secrets; print(secrets.token_urlsafe(32))'`")
    if api_key is None and not is_loopback(host):
        raise ConfigError(f"--host {host} is reachable from other machines: give --api-key KEY (or H3_API_KEY) so that only holders of the key can use it, or bind 127.0.0.1")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def serve(job: ServeJob, say: Say = lambda line: None) -> None:
    """Run the server until Ctrl-C or SIGTERM (module docstring); `say` prints rank 0's status lines."""
    check_binding(job.host, job.api_key)
    if not settings.is_rank_zero():
        return _follow(job)
    from h3core.generate.request import resolve

    resolve(job.template)  # the flags alone resolve (exit 2 before anything is taken)
    state_dir = Path(job.state_dir)
    with ResultsFolder(state_dir / "jobs", "--state-dir", INDEX) as results:
        results.write_index(_index(job))
        queue = JobQueue(state_dir)
        try:
            _run(ServerState(job, queue), results, say)
        finally:
            queue.close()


def _run(state: ServerState, results: ResultsFolder, say: Say) -> None:
    job = state.job
    recovered = state.queue.recover(state.folder_of)
    _sweep(state, recovered.deleted)
    listening = _bind(job.host, job.port)
    host, port = listening.getsockname()[:2]
    say(f"h3 serve: http://{host}:{port}/ · model {job.served_model} · {job.template.world_size} rank(s), "
        f"{job.template.replicas} replica group(s) · state {job.state_dir} · loading")
    if recovered.requeued or recovered.completed or recovered.failed:
        say(f"recovered: {recovered.completed} completed, {len(recovered.requeued)} re-queued after an interruption"
            + (f", {len(recovered.failed)} failed after {len(recovered.failed)} interruptions" if recovered.failed else ""))
    http = _start_http(state, listening)
    pump = ProgressPump(state).start()
    engine = Engine(state, results)
    try:
        _engine_ready(engine, state, say)
    except KeyboardInterrupt as stop:
        state.phase = "stopping"
        engine.close()  # every rank stopped before the jobs go back to the queue
        requeued = state.queue.requeue_running()
        what = f"; {len(requeued)} running job(s) re-queued, nothing of them written" if requeued else "; no job was running"
        raise Interrupted.by(stop, f"{what} (the queue is in {job.state_dir}: start the server again to go on)") from None
    except BaseException as err:
        state.phase, state.message = "failed", " ".join(str(err).split())
        raise
    finally:
        state.phase = "stopping" if state.phase == "ok" else state.phase
        engine.close()
        state.queue.requeue_running()
        http.stop()
        pump.stop()


def _engine_ready(engine: Engine, state: ServerState, say: Say) -> None:
    """Run the engine, saying once when it is ready."""
    def announce() -> None:
        while state.phase == "loading":
            time.sleep(0.05)
        if state.phase == "ok":
            say(f"ready: loaded in {state.metrics.load_seconds:.1f}s; Ctrl-C or SIGTERM stops the server (running jobs are re-queued)")

    threading.Thread(target=announce, name="h3-serve-announce", daemon=True).start()
    engine.run()


def _follow(job: ServeJob) -> None:
    """A torchrun rank other than 0: the engine only (rank 0 serves and decides)."""
    engine = Engine(ServerState(job, None), None)  # type: ignore[arg-type]
    try:
        engine.run()
    except KeyboardInterrupt as stop:
        raise Interrupted.by(stop, "; this rank stopped") from None
    finally:
        engine.close()


def _index(job: ServeJob) -> bytes:
    info = {"command": "serve", "updated": timestamp(), "model": job.served_model, "template": job.template.model_dump(mode="json"),
            "versions": Versions.collect().model_dump(mode="json")}
    return (json.dumps(info, indent=2) + "\n").encode()


def _sweep(state: ServerState, deleted: list[str]) -> None:
    """Files a crash left: deleted jobs' folders and inputs, staging folders nobody will publish."""
    for job_id in deleted:
        state.remove_files(job_id)
    for leftover in (state.job.state_dir / "jobs").glob(".*.h3-staging-*"):
        shutil.rmtree(leftover, ignore_errors=True)


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {err.strerror or err}; choose another --port (0: any free one) or --host") from None
    sock.listen(128)
    sock.set_inheritable(False)
    return sock


HEADER_BYTES = 64 << 10
"""The most a request's line and headers may take (h11's bound on an incomplete event); more is a 400."""


def uvicorn_config(app: Any, limits: Limits) -> "uvicorn.Config":
    """How uvicorn serves `app`: h11 (pinned with uvicorn; pure Python) with the headers bounded
    (`HEADER_BYTES`) and a deadline for each request's head (`HeadDeadline`), keep-alive 5 s, at most
    256 connections (more are 503s), no server header, no access log."""
    import uvicorn

    return uvicorn.Config(app, http=HeadDeadline.bound(limits.head_seconds), h11_max_incomplete_event_size=HEADER_BYTES,
                          log_level="warning", access_log=False, lifespan="off", timeout_graceful_shutdown=2, timeout_keep_alive=5,
                          limit_concurrency=256, server_header=False)


class HeadDeadline(H11Protocol):
    """uvicorn's h11 connection with a deadline for each request's head (slowloris): a client that has
    not sent a whole request line and headers within `head_seconds` of connecting, or of its previous
    response, is disconnected. uvicorn itself times only the idle wait between requests, and that
    timer stops at the first byte, so a client sending a byte now and then held a connection (one of
    `limit_concurrency`) for ever. Once the head is in, the body's own deadline is the app's (`Guard`)."""

    head_seconds = 10.0

    @classmethod
    def bound(cls, head_seconds: float) -> type["HeadDeadline"]:
        return type(cls.__name__, (cls,), {"head_seconds": head_seconds})

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        self._await_head()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._await_head()

    def _await_head(self) -> None:
        self.loop.call_later(self.head_seconds, self._drop_without_head, self.cycle)

    def _drop_without_head(self, cycle_then: Any) -> None:
        """No request began since the deadline was set (the connection's cycle is the same one)."""
        if self.cycle is cycle_then and not self.transport.is_closing():
            self.transport.close()


class _Http:
    """uvicorn on a thread, on a socket bound here."""

    def __init__(self, state: ServerState, sock: socket.socket):
        import uvicorn

        from h3core.serve.app import build_app

        self.server = uvicorn.Server(uvicorn_config(build_app(state), state.job.limits))
        self.sock = sock
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, name="h3-serve-http", daemon=True)

    def start(self) -> "_Http":
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started and self.thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.02)
        if not self.server.started:
            self.stop()
            raise ConfigError(f"the HTTP server did not start on {self.sock.getsockname()}; rerun with {settings.DEBUG}=1 to see why")
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=5)
        self.sock.close()


def _start_http(state: ServerState, sock: socket.socket) -> _Http:
    return _Http(state, sock).start()
