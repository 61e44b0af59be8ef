"""The head server, and a uvicorn server run in a thread of this process.

The head server is the mesh's directory for a second shell: ``GET /servers`` answers a JSON list of
``{name, type, implementation, url}`` (docs/architecture.md section 4) and ``GET /health`` says it is up.
It runs inside the launcher's process as a ``ThreadedServer``, which the tests use as well: the
socket is bound before the thread starts (so port 0 picks a free port and the URL is known at once),
``start`` returns only once uvicorn has started, and ``stop`` is bounded.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from types import TracebackType
from typing import Any

import uvicorn
from fastapi import FastAPI

from nemo_gym_ckpt.config import MeshConfig
from nemo_gym_ckpt.server import create_app

__all__ = ["HEAD_NAME", "ServerEntry", "ThreadedServer", "create_head_app", "server_entries"]

HEAD_NAME = "head_server"
logger = logging.getLogger(__name__)

ServerEntry = dict[str, str]


def server_entries(mesh: MeshConfig) -> list[ServerEntry]:
    """What ``GET /servers`` answers: one entry per instance, in config order."""
    return [
        {"name": inst.name, "type": inst.type, "implementation": inst.implementation, "url": inst.url}
        for inst in mesh.instances.values()
    ]


def create_head_app(mesh: MeshConfig) -> FastAPI:
    """The head server's app for a mesh whose ports are all assigned."""
    entries = server_entries(mesh)
    app = create_app(HEAD_NAME)

    @app.get("/servers")
    async def servers() -> list[ServerEntry]:
        return entries

    return app


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (port 0: a free one); ``OSError`` if taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    return sock


class ThreadedServer:
    """A uvicorn server for ``app`` in a daemon thread of this process.

    Use as a context manager, or call ``start`` and ``stop``. ``OSError`` from ``start`` means the
    port could not be bound; ``RuntimeError`` means uvicorn did not start within the deadline.
    """

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0, *, name: str = "server") -> None:
        self.app = app
        self.host = host
        self.name = name
        self._requested_port = port
        self._port: int | None = None
        self._socket: socket.socket | None = None
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError(f"{self.name} was never started")
        return self._port

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self, timeout_s: float = 10.0) -> None:
        """Bind, start uvicorn in a thread and wait until it serves (or fail within ``timeout_s``)."""
        self._socket = bind_socket(self.host, self._requested_port)
        self._port = int(self._socket.getsockname()[1])
        config = uvicorn.Config(
            self.app, loop="asyncio", log_config=None, log_level="warning", timeout_graceful_shutdown=2
        )
        self._server = server = uvicorn.Server(config)
        sock = self._socket
        self._thread = threading.Thread(
            target=lambda: server.run(sockets=[sock]), name=self.name, daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{self.name} did not start on {self.host} within {timeout_s:g} s")
            time.sleep(0.01)
        logger.debug("%s serving at %s", self.name, self.url)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Ask uvicorn to exit and join its thread; force the exit after half the time."""
        if self._server is not None and self._thread is not None:
            self._server.should_exit = True
            self._thread.join(timeout_s / 2)
            if self._thread.is_alive():
                self._server.force_exit = True
                self._thread.join(timeout_s / 2)
            if self._thread.is_alive():
                logger.warning("%s thread did not stop within %g s", self.name, timeout_s)
        if self._socket is not None:
            self._socket.close()
        self._server = None
        self._thread = None

    def __enter__(self) -> ThreadedServer:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
