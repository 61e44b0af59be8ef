"""The HTTP session the OTLP exporters send through (``otlp.py``): one total deadline per request.

The OTLP/HTTP exporter sends with ``requests`` and gives each request the time its export has left
as ``timeout``; ``requests`` and urllib3 apply a timeout to each socket operation only, so an endpoint
that sends one byte of its reply every half second kept one export running for ever. Here each
request runs under a watch: when its time is up, the sockets it uses are shut down, the read or
write in progress ends at once, and the request fails with ``requests``' ``ReadTimeout``, which the
exporter counts as a failed try (its retries stop at the export's own deadline). No time is taken
from a request that ends in time: the watch is a timer thread, cancelled when the request is done.

Imported only when telemetry is on (``requests`` comes with the OTLP exporter, the ``otel`` extra).
"""

from __future__ import annotations

import contextlib
import socket
import threading
from types import TracebackType
from typing import Any

import requests
from requests.adapters import HTTPAdapter
from urllib3 import HTTPConnectionPool, HTTPSConnectionPool, ProxyManager
from urllib3.connection import HTTPConnection, HTTPSConnection

__all__ = ["DeadlineSession"]

_local = threading.local()
"""``watch``: the ``_Watch`` of the request this thread is sending, if any."""


class _Watch:
    """One request's deadline: the sockets the request uses are shut down if it is still running
    when ``seconds`` have passed (``expired`` then says so)."""

    def __init__(self, seconds: float) -> None:
        self.expired = False
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._timer = threading.Timer(seconds, self._expire)
        self._timer.daemon = True
        self._outer: _Watch | None = None

    def __enter__(self) -> _Watch:
        self._outer = getattr(_local, "watch", None)  # a redirect is sent inside its request
        _local.watch = self
        self._timer.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self._timer.cancel()
        _local.watch = self._outer

    def add(self, sock: Any) -> None:
        """Watch ``sock`` too (shut at once if the time is already up)."""
        if not isinstance(sock, socket.socket):  # TLS inside a proxy's TLS: no socket of its own here
            return
        with self._lock:
            self._sockets.append(sock)
            if self.expired:
                _shut(sock)

    def _expire(self) -> None:
        with self._lock:
            self.expired = True
            for sock in self._sockets:
                _shut(sock)


def _shut(sock: socket.socket) -> None:
    """End every read and write on ``sock`` now, from another thread (a TLS socket's own
    ``shutdown`` would also drop its TLS state under the reading thread: the plain socket's is used)."""
    with contextlib.suppress(OSError):  # already closed, or never connected
        socket.socket.shutdown(sock, socket.SHUT_RDWR)


def _watched(sock: Any) -> None:
    watch = getattr(_local, "watch", None)
    if watch is not None and sock is not None:
        watch.add(sock)


class _WatchedHTTPConnection(HTTPConnection):
    """A connection whose socket is watched by the request that uses it (a pooled one as well)."""

    def connect(self) -> None:
        super().connect()
        _watched(self.sock)

    def request(self, *args: Any, **kwargs: Any) -> None:
        _watched(self.sock)  # a pooled connection, connected by an earlier request
        super().request(*args, **kwargs)


class _WatchedHTTPSConnection(HTTPSConnection):
    def connect(self) -> None:
        super().connect()
        _watched(self.sock)

    def request(self, *args: Any, **kwargs: Any) -> None:
        _watched(self.sock)
        super().request(*args, **kwargs)


class _WatchedHTTPPool(HTTPConnectionPool):
    ConnectionCls = _WatchedHTTPConnection


class _WatchedHTTPSPool(HTTPSConnectionPool):
    ConnectionCls = _WatchedHTTPSConnection


_POOLS = {"http": _WatchedHTTPPool, "https": _WatchedHTTPSPool}


class _WatchedAdapter(HTTPAdapter):
    """``requests``' adapter, its connections (direct or through an HTTP proxy) watched."""

    def init_poolmanager(self, *args: Any, **kwargs: Any) -> None:
        super().init_poolmanager(*args, **kwargs)
        self.poolmanager.pool_classes_by_scheme = _POOLS

    def proxy_manager_for(self, proxy: str, **proxy_kwargs: Any) -> Any:
        manager = super().proxy_manager_for(proxy, **proxy_kwargs)
        if isinstance(manager, ProxyManager):  # not a SOCKS proxy's, which has pools of its own
            manager.pool_classes_by_scheme = _POOLS
        return manager


class DeadlineSession(requests.Session):
    """A ``requests`` session whose every request ends within its ``timeout`` (a number of seconds),
    at most ``limit_s``, its reply read whole: one total deadline, not one per socket operation."""

    def __init__(self, limit_s: float) -> None:
        super().__init__()
        self.limit_s = limit_s
        adapter = _WatchedAdapter()
        self.mount("http://", adapter)
        self.mount("https://", adapter)

    def send(self, request: requests.PreparedRequest, **kwargs: Any) -> requests.Response:
        timeout = kwargs.get("timeout")
        seconds = min(float(timeout), self.limit_s) if isinstance(timeout, int | float) else self.limit_s
        with _Watch(max(seconds, 0.0)) as watch:
            try:
                response: requests.Response | None = super().send(request, **kwargs)
            except requests.RequestException:
                if not watch.expired:
                    raise
                response = None  # the shut socket's error: the deadline is what happened
        if response is None or watch.expired:  # its sockets were shut mid-reply: what was read is not the reply
            if response is not None:
                response.close()
            raise requests.exceptions.ReadTimeout(f"no whole reply within {seconds:g} s", request=request)
        return response
