"""Bounds for a whole HTTP answer on `requests`: a deadline and a size cap, whatever the server does.

`requests`' timeout bounds every single read: a server that sends one byte every 5 s never trips
a 30 s timeout, and the request never ends; and nothing bounds the size of a body (an endless
one, or a gzip bomb that inflates a few kB into gigabytes). Two guards close both:

- `Deadline(seconds).call(fn)` bounds the whole exchange (connect, TLS, send, headers, body):
  `fn` runs in a helper thread and the caller gets its answer, or `DeadlinePassed`, within
  `seconds` (plus a short grace), whatever the helper is blocked in. Every socket the helper's
  connections open or reuse registers with its deadline the moment it exists (not the connection
  object: on an HTTP/1.0 or `Connection: close` answer `http.client` hands the socket over to the
  response and forgets it); when the deadline passes they are shut down, so the helper's blocked
  read fails at once too and `Deadline.expired` tells why.
- `CappedBody` wraps every answer's body: the bytes it yields, after decompression, are counted,
  and past `max_bytes` it raises `AnswerTooLarge`. urllib3 decompresses at most the amount asked
  for per read, so a bomb never inflates more than one read's worth beyond the cap. It also
  stops at the first read after the deadline passed, whatever the socket does.

`BoundedAdapter` is the transport adapter that applies both; mount it for `http://` and
`https://`. Outside `Deadline.call` sockets are not watched, but bodies are still capped.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any, Callable, Iterator, TypeVar

from requests.adapters import HTTPAdapter
from urllib3.connection import HTTPConnection, HTTPSConnection
from urllib3.connectionpool import HTTPConnectionPool, HTTPSConnectionPool

MAX_ANSWER_BYTES = 8 << 20
"""The largest answer body h3 reads (decompressed): RunPod's answers are a few kB; a pod list of
hundreds of pods is well under 1 MiB."""

_active = threading.local()
R = TypeVar("R")


class AnswerTooLarge(Exception):
    """An answer's body grew past the cap (`limit` bytes, decompressed)."""

    def __init__(self, limit: int):
        super().__init__(f"the answer is larger than {limit >> 20} MiB")
        self.limit = limit


class DeadlinePassed(Exception):
    """The body was still arriving when the whole-exchange deadline passed."""


class Deadline:
    """`Deadline(s).call(fn)`: `fn()` within `s` seconds, or `DeadlinePassed`; see the module docstring.

    `fn` runs in a helper thread while the calling thread waits (in short slices, so that Ctrl-C
    and SIGTERM reach it at once). When `s` seconds pass, every socket `fn` registered is shut
    down and the helper gets a moment to end with its own error; the caller returns by then
    whatever the helper does (a stalled DNS look-up or TLS handshake is left behind, daemonic).
    """

    GRACE_S = 0.5
    """After the deadline: how long the caller waits for the helper's own error before giving up on it."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.expired = False
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []

    def call(self, fn: Callable[[], R]) -> R:
        outcome: dict[str, Any] = {}
        done = threading.Event()

        def work() -> None:
            _active.deadline = self
            try:
                outcome["value"] = fn()
            except BaseException as err:  # handed to the caller as it is
                outcome["error"] = err
            finally:
                _active.deadline = None
                done.set()

        threading.Thread(target=work, name="h3-http", daemon=True).start()
        try:
            if not _wait(done, self.seconds):
                self.expire()
                _wait(done, self.GRACE_S)
        except BaseException:  # Ctrl-C or SIGTERM while waiting: end the exchange too
            self.expire()
            raise
        if not done.is_set():
            raise DeadlinePassed()
        if "error" in outcome:
            raise outcome["error"]
        return outcome["value"]

    def watch(self, sock: socket.socket | None) -> None:
        """Shut `sock` down when the deadline passes (at once if it already has)."""
        if sock is None:
            return
        with self._lock:
            if self.expired:
                _shut(sock)
            else:
                self._sockets.append(sock)

    def expire(self) -> None:
        with self._lock:
            self.expired = True
            for sock in self._sockets:
                _shut(sock)


def _wait(event: threading.Event, seconds: float) -> bool:
    """`event.wait(seconds)` in slices of 0.1 s: a signal's handler runs between them."""
    end = time.monotonic() + seconds
    while not event.is_set():
        left = end - time.monotonic()
        if left <= 0:
            return False
        event.wait(min(left, 0.1))
    return True


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)  # works while any owner (connection or response) still reads it
    except OSError:
        pass  # already closed


def _watch(sock: socket.socket | None) -> None:
    deadline = getattr(_active, "deadline", None)
    if deadline is not None:
        deadline.watch(sock)


def _check_deadline() -> None:
    deadline = getattr(_active, "deadline", None)
    if deadline is not None and deadline.expired:
        raise DeadlinePassed()


class _Watched:
    """A connection that registers its socket the moment it is made, again once connected (HTTPS:
    the TLS socket that wraps the first), and on every reuse of a kept-alive connection."""

    sock: socket.socket | None

    def _new_conn(self) -> socket.socket:
        sock = super()._new_conn()  # type: ignore[misc]
        _watch(sock)
        return sock

    def connect(self) -> None:
        super().connect()  # type: ignore[misc]
        _watch(self.sock)

    def request(self, *args: Any, **kwargs: Any) -> Any:
        _watch(self.sock)
        return super().request(*args, **kwargs)  # type: ignore[misc]


class _WatchedHTTPConnection(_Watched, HTTPConnection):
    pass


class _WatchedHTTPSConnection(_Watched, HTTPSConnection):
    pass


class _HTTPPool(HTTPConnectionPool):
    ConnectionCls = _WatchedHTTPConnection


class _HTTPSPool(HTTPSConnectionPool):
    ConnectionCls = _WatchedHTTPSConnection


_POOLS = {"http": _HTTPPool, "https": _HTTPSPool}


class CappedBody:
    """An urllib3 response whose body reads (`stream`, `read`) stop at `max_bytes` decompressed
    bytes and at the deadline; everything else is the response's own."""

    def __init__(self, response: Any, max_bytes: int):
        self._response = response
        self._max_bytes = max_bytes
        self._seen = 0

    def _count(self, data: bytes) -> bytes:
        self._seen += len(data)
        if self._seen > self._max_bytes:
            self._response.close()
            raise AnswerTooLarge(self._max_bytes)
        _check_deadline()
        return data

    def stream(self, amt: int | None = 2**16, decode_content: bool | None = None) -> Iterator[bytes]:
        for chunk in self._response.stream(amt, decode_content=decode_content):
            yield self._count(chunk)

    def read(self, amt: int | None = None, **kwargs: Any) -> bytes:
        if amt is None:  # "the rest": read it in pieces, so that the cap holds on the way
            return b"".join(self.stream(2**16, decode_content=kwargs.get("decode_content")))
        return self._count(self._response.read(amt, **kwargs))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._response, name)


class BoundedAdapter(HTTPAdapter):
    """An `HTTPAdapter` whose sockets (also through a proxy) answer to `Deadline` and whose bodies
    are capped at `max_bytes` (decompressed)."""

    def __init__(self, max_bytes: int = MAX_ANSWER_BYTES, **kwargs: Any):
        self.max_bytes = max_bytes
        super().__init__(**kwargs)

    def init_poolmanager(self, *args: Any, **kwargs: Any) -> None:
        super().init_poolmanager(*args, **kwargs)
        self.poolmanager.pool_classes_by_scheme = dict(_POOLS)

    def proxy_manager_for(self, proxy: str, **kwargs: Any) -> Any:
        manager = super().proxy_manager_for(proxy, **kwargs)
        manager.pool_classes_by_scheme = dict(_POOLS)
        return manager

    def build_response(self, req: Any, resp: Any) -> Any:
        response = super().build_response(req, resp)
        response.raw = CappedBody(resp, self.max_bytes)
        return response
