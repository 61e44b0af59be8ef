"""A mesh served in this process: every app behind one transport that routes by URL.

Each instance gets a made-up ``127.0.0.1:<port>`` URL in a ``MeshConfig``; the servers' mesh clients
reach one another through ``RoutingTransport``, which hands each request to the app at that address
over ``httpx.ASGITransport`` (real HTTP requests and replies, no sockets). An address with no app
fails to connect, as a dead server would.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import httpx
from fastapi import FastAPI

from nemo_gym_ckpt.client import MeshClient
from nemo_gym_ckpt.config import CheckpointConfig, HeadServerConfig, MeshConfig, ServerConfig, ServerInstance
from nemo_gym_ckpt.context import ServerContext

__all__ = ["InProcessMesh", "RoutingTransport"]

_PORTS = itertools.count(21000)


class RoutingTransport(httpx.AsyncBaseTransport):
    """Sends each request to the ASGI app registered for its ``host:port``."""

    def __init__(self) -> None:
        self.apps: dict[str, httpx.ASGITransport] = {}

    def mount(self, url: str, app: FastAPI) -> None:
        parsed = httpx.URL(url)
        self.apps[f"{parsed.host}:{parsed.port}"] = httpx.ASGITransport(app=app)

    def unmount(self, url: str) -> None:
        parsed = httpx.URL(url)
        self.apps.pop(f"{parsed.host}:{parsed.port}", None)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        target = self.apps.get(f"{request.url.host}:{request.url.port}")
        if target is None:
            where = f"{request.url.host}:{request.url.port}"
            raise httpx.ConnectError(f"nothing listens on {where}", request=request)
        return await target.handle_async_request(request)


class InProcessMesh:
    """Instances declared up front (so URLs resolve), then their apps built and mounted."""

    def __init__(self, instances: dict[str, tuple[str, str, ServerConfig]]) -> None:
        resolved = {}
        for name, (server_type, implementation, settings) in instances.items():
            placed = settings.model_copy(update={"host": "127.0.0.1", "port": next(_PORTS)})
            resolved[name] = ServerInstance(name, server_type, implementation, placed)  # type: ignore[arg-type]
        head, checkpoint = HeadServerConfig.model_validate({}), CheckpointConfig.model_validate({})
        self.mesh = MeshConfig(head, checkpoint, resolved, raw={})
        self.transport = RoutingTransport()
        self._clients: list[MeshClient] = []

    def client(self, **kwargs: Any) -> MeshClient:
        client = MeshClient(transport=self.transport, backoff_s=0.001, **kwargs)
        self._clients.append(client)
        return client

    def context(self, name: str) -> ServerContext[Any]:
        return ServerContext(name, self.mesh.instance(name).settings, self.mesh, self.client())

    def build(self, name: str, create_app: Callable[[ServerContext[Any]], FastAPI]) -> FastAPI:
        app = create_app(self.context(name))
        self.serve(name, app)
        return app

    def serve(self, name: str, app: FastAPI) -> None:
        self.transport.mount(self.url_of(name), app)

    def url_of(self, name: str) -> str:
        return self.mesh.url_of(name)

    async def aclose(self) -> None:
        for client in self._clients:
            await client.aclose()
