"""A deadline for a whole HTTP request on `requests`, not only for each socket read.

`requests`' timeout bounds every single read: a server that sends one byte every 5 s never
trips a 30 s timeout, and the request never ends. `Deadline(seconds)` bounds the whole exchange
(connect, send, headers, body): the session's connections register with the deadline of the
thread that uses them, and when it passes, a timer thread shuts their sockets down. The blocked
read then fails at once, `requests` raises, and `Deadline.expired` tells the caller why.

`DeadlineAdapter` is the transport adapter that makes a session's connections register; mount it
for `http://` and `https://`. Outside a `with Deadline(...)` block the connections behave as usual.
"""

from __future__ import annotations

import socket
import threading
from typing import Any

from requests.adapters import HTTPAdapter
from urllib3.connection import HTTPConnection, HTTPSConnection
from urllib3.connectionpool import HTTPConnectionPool, HTTPSConnectionPool

_active = threading.local()


class Deadline:
    """`with Deadline(s) as d:` shuts down the connections used in the block once `s` seconds pass."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.expired = False
        self._lock = threading.Lock()
        self._done = False
        self._connections: list[HTTPConnection] = []
        self._timer = threading.Timer(seconds, self._expire)
        self._timer.daemon = True

    def __enter__(self) -> "Deadline":
        _active.deadline = self
        self._timer.start()
        return self

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            self._done = True
        self._timer.cancel()
        _active.deadline = None

    def watch(self, connection: HTTPConnection) -> None:
        with self._lock:
            if self.expired:
                _shut(connection)
            else:
                self._connections.append(connection)

    def _expire(self) -> None:
        with self._lock:
            if self._done:
                return
            self.expired = True
            for connection in self._connections:
                _shut(connection)


def _shut(connection: HTTPConnection) -> None:
    sock = getattr(connection, "sock", None)
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # already closed


def _watch(connection: HTTPConnection) -> None:
    deadline = getattr(_active, "deadline", None)
    if deadline is not None:
        deadline.watch(connection)


class _WatchedHTTPConnection(HTTPConnection):
    def request(self, *args: Any, **kwargs: Any) -> Any:
        _watch(self)  # before connecting: the socket is looked up when the deadline passes
        return super().request(*args, **kwargs)


class _WatchedHTTPSConnection(HTTPSConnection):
    def request(self, *args: Any, **kwargs: Any) -> Any:
        _watch(self)
        return super().request(*args, **kwargs)


class _HTTPPool(HTTPConnectionPool):
    ConnectionCls = _WatchedHTTPConnection


class _HTTPSPool(HTTPSConnectionPool):
    ConnectionCls = _WatchedHTTPSConnection


_POOLS = {"http": _HTTPPool, "https": _HTTPSPool}


class DeadlineAdapter(HTTPAdapter):
    """An `HTTPAdapter` whose connections (also through a proxy) answer to `Deadline`."""

    def init_poolmanager(self, *args: Any, **kwargs: Any) -> None:
        super().init_poolmanager(*args, **kwargs)
        self.poolmanager.pool_classes_by_scheme = dict(_POOLS)

    def proxy_manager_for(self, proxy: str, **kwargs: Any) -> Any:
        manager = super().proxy_manager_for(proxy, **kwargs)
        manager.pool_classes_by_scheme = dict(_POOLS)
        return manager
