"""The head server, and a uvicorn server run in a thread of this process.

The head server is the mesh's directory for a second shell and for controllers:

- ``GET /servers``: a JSON list of ``{name, type, implementation, url}`` (docs/architecture.md
  section 4);
- ``GET /global_config_dict_yaml``: as NeMo Gym's head answers it, a JSON *string* whose content is
  the YAML of the resolved global config, every instance with its ``host`` and ``port``, every
  secret redacted (``launch/redaction.py``: the control token, the whole value of every key that
  names a credential, and such a value or a URL's ``user:password@`` inside any other string; a
  ``host`` is never changed). NeMo Gym's ``ServerClient`` and NeMo RL's adapter read the mesh from
  it (``json.loads``, then the YAML);
- ``GET /server_instances``: NeMo Gym's list of ``ServerInstanceDisplayConfig`` objects
  (``config_path``, ``dir_path``, ``entrypoint``, ``host``, ``name``, ``pid``, ``port``,
  ``process_name``, ``server_type``, ``start_time``, ``status``, ``uptime_seconds``, ``url``);
- ``GET /health``: it is up.
It runs inside the launcher's process as a ``ThreadedServer``, which the tests use as well: the
socket is bound before the thread starts (so port 0 picks a free port and the URL is known at once),
``start`` returns only once uvicorn has started, and ``stop`` is bounded.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import Any

import uvicorn
from fastapi import FastAPI

from nemo_gym_ckpt.config import PROJECT_ROOT, MeshConfig, http_url
from nemo_gym_ckpt.config_yaml import dump_yaml
from nemo_gym_ckpt.launch.child import SERVER_KEEPALIVE_S
from nemo_gym_ckpt.launch.redaction import redacted, secret_values
from nemo_gym_ckpt.launch.workers import BACKLOG
from nemo_gym_ckpt.server import create_app

__all__ = [
    "HEAD_NAME",
    "Processes",
    "ServerEntry",
    "ThreadedServer",
    "create_head_app",
    "global_config_yaml",
    "server_entries",
    "server_instances",
]

HEAD_NAME = "head_server"
logger = logging.getLogger(__name__)

ServerEntry = dict[str, str]
Processes = Callable[[], Mapping[str, tuple[int, float]]]
"""The running server processes: instance name -> (pid, start time in Unix seconds)."""
DEFAULT_ENTRYPOINT = "app.py"


def server_entries(mesh: MeshConfig) -> list[ServerEntry]:
    """What ``GET /servers`` answers: one entry per instance, in config order."""
    return [
        {"name": inst.name, "type": inst.type, "implementation": inst.implementation, "url": inst.url}
        for inst in mesh.instances.values()
    ]


def _with_addresses(mesh: MeshConfig) -> dict[str, Any]:
    """The resolved config with every instance's ``host`` and ``port`` written out."""
    raw = {key: value for key, value in mesh.raw.items()}
    for inst in mesh.instances.values():
        given = raw.get(inst.name, {}).get(inst.type, {}).get(inst.implementation)
        block = dict(given) if isinstance(given, Mapping) else inst.settings.model_dump(mode="json")
        block.update(host=inst.settings.host, port=inst.settings.port)
        raw[inst.name] = {inst.type: {inst.implementation: block}}
    raw["head_server"] = {**(raw.get("head_server") or {}), "host": mesh.head_server.host,
                          "port": mesh.head_server.port}
    return raw


def global_config_yaml(mesh: MeshConfig) -> str:
    """The YAML text ``GET /global_config_dict_yaml`` carries (as a JSON string), secrets redacted."""
    raw = _with_addresses(mesh)
    token = mesh.checkpoint.control_auth_token
    secrets = secret_values(raw) | ({token.get_secret_value()} if token is not None else set())
    return dump_yaml(redacted(raw, secrets - {""}), allow_unicode=False)


def server_instances(mesh: MeshConfig, processes: Processes | None = None) -> list[dict[str, Any]]:
    """What ``GET /server_instances`` answers: NeMo Gym's display config of each instance."""
    running = processes() if processes is not None else {}
    instances = []
    for inst in mesh.instances.values():
        pid, started = running.get(inst.name, (None, None))
        instances.append({
            "config_path": inst.name,
            "dir_path": str(PROJECT_ROOT / inst.type / inst.implementation),
            "entrypoint": getattr(inst.settings, "entrypoint", None) or DEFAULT_ENTRYPOINT,
            "host": inst.settings.host,
            "name": inst.implementation,
            "pid": pid,
            "port": inst.settings.port,
            "process_name": inst.name,
            "server_type": inst.type,
            "start_time": started,
            "status": None,
            "uptime_seconds": None,
            "url": inst.url,
        })
    return instances


def create_head_app(mesh: MeshConfig, processes: Processes | None = None) -> FastAPI:
    """The head server's app for a mesh whose ports are all assigned (``processes``: the running
    children, for ``/server_instances``)."""
    entries = server_entries(mesh)
    config_yaml = global_config_yaml(mesh)
    app = create_app(HEAD_NAME)

    @app.get("/servers")
    async def servers() -> list[ServerEntry]:
        return entries

    @app.get("/global_config_dict_yaml")
    async def global_config_dict_yaml() -> str:
        return config_yaml

    @app.get("/server_instances")
    async def instances() -> list[dict[str, Any]]:
        return server_instances(mesh, processes)

    return app


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (port 0: a free one); ``OSError`` if taken.

    Made with ``IPPROTO_TCP`` named: asyncio turns Nagle's algorithm off (``TCP_NODELAY``) only on
    connections whose socket says so, and uvicorn writes a reply's head and body apart, so with
    protocol 0 every reply's body waited for the client's delayed ACK (about 40 ms)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(BACKLOG)
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
        return http_url(self.host, self.port)

    def start(self, timeout_s: float = 10.0) -> None:
        """Bind, start uvicorn in a thread and wait until it serves (or fail within ``timeout_s``)."""
        self._socket = bind_socket(self.host, self._requested_port)
        self._port = int(self._socket.getsockname()[1])
        config = uvicorn.Config(
            self.app, loop="asyncio", log_config=None, log_level="warning", timeout_graceful_shutdown=2,
            backlog=BACKLOG, timeout_keep_alive=SERVER_KEEPALIVE_S,  # uvicorn listens again on the socket
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

    def begin_stop(self) -> None:
        """Ask uvicorn to exit, without waiting: its shutdown (about 0.15 s: it looks for the request
        every 0.1 s, then waits 0.1 s for open connections) runs while the caller does other work,
        and ``stop`` joins it."""
        if self._server is not None:
            self._server.should_exit = True

    def stop(self, timeout_s: float = 5.0) -> None:
        """Ask uvicorn to exit and join its thread; force the exit after half the time."""
        if self._server is not None and self._thread is not None:
            self.begin_stop()
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
