"""Where a test runs the apps of a participant under test, and the participant as the suite sees it.

``Placement.run(app)`` serves one app, lifespan included, at a URL: ``InProcess`` puts every app
behind one ``RoutingTransport`` (no sockets), ``Sockets`` on real uvicorn servers (a ``serve_app``
callable, such as the one ``nemo_gym_ckpt.testing.sockets`` gives). ``mesh_of`` and
``instance_at`` build the ``MeshConfig`` of apps placed at known URLs; ``under_test`` turns a
``Stack`` (the server under test, its URL, its data-plane hooks) into the conformance suite's
``ParticipantUnderTest``.
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from fastapi import FastAPI

from nemo_gym_ckpt.checkpoint.clock import Clock
from nemo_gym_ckpt.client import MeshClient, verifying_ssl_context
from nemo_gym_ckpt.config import CheckpointConfig, HeadServerConfig, MeshConfig, ServerConfig, ServerInstance
from nemo_gym_ckpt.context import ServerContext
from nemo_gym_ckpt.server import close_on_shutdown
from nemo_gym_ckpt.testing.clock import FakeClock
from nemo_gym_ckpt.testing.conformance import DataHooks, ParticipantUnderTest
from nemo_gym_ckpt.testing.transports import RoutingTransport

__all__ = [
    "InProcess",
    "Placement",
    "Sockets",
    "Stack",
    "checkpoint_config",
    "closing_ctx",
    "instance_at",
    "mesh_of",
    "under_test",
]


def checkpoint_config(root: Path, token: str, grace_s: float = 600.0) -> CheckpointConfig:
    """Checkpointing on, confined to ``root``, with ``token`` as the control token."""
    return CheckpointConfig.model_validate(
        {"enabled": True, "control_auth_token": token, "root": root, "lease_grace_seconds": grace_s}
    )


_PORTS = itertools.count(23000)

class Placement:
    """Where the apps of a stack run: ``run(app)`` serves one (its lifespan included) at a URL."""

    def run(self, app: FastAPI) -> AbstractAsyncContextManager[str]:
        raise NotImplementedError

    def mesh_client(self) -> MeshClient:
        raise NotImplementedError

    def client(self, url: str) -> httpx.AsyncClient:
        raise NotImplementedError

class InProcess(Placement):
    """Every app behind one ``RoutingTransport``: requests and replies without sockets."""

    def __init__(self) -> None:
        self.transport = RoutingTransport()

    @staticmethod
    def reserve() -> str:
        """A fresh URL to ``run`` an app at later (for meshes that name it before it exists)."""
        return f"http://127.0.0.1:{next(_PORTS)}"

    @asynccontextmanager
    async def run(self, app: FastAPI, url: str | None = None) -> AsyncIterator[str]:
        url = url or self.reserve()
        async with app.router.lifespan_context(app):
            self.transport.mount(url, app)
            try:
                yield url
            finally:
                self.transport.unmount(url)

    def mesh_client(self) -> MeshClient:
        return MeshClient(transport=self.transport, backoff_s=0.001)

    def client(self, url: str) -> httpx.AsyncClient:
        return httpx.AsyncClient(transport=self.transport, base_url=url, timeout=30)

class Sockets(Placement):
    """Every app on its own real uvicorn server (``serve_app``, which runs the lifespan and stops it)."""

    def __init__(self, serve_app: Callable[[Any], str]) -> None:
        self.serve_app = serve_app

    @asynccontextmanager
    async def run(self, app: FastAPI) -> AsyncIterator[str]:
        yield self.serve_app(app)

    def mesh_client(self) -> MeshClient:
        return MeshClient(transport="httpx", backoff_s=0.001)

    def client(self, url: str) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=url, timeout=30, verify=verifying_ssl_context())

def closing_ctx(app: FastAPI, ctx: ServerContext[Any]) -> FastAPI:
    """``app`` with ``ctx`` (its client) closed when the app shuts down, in the app's own loop.

    A server's ``create_app`` does it already; this is for apps built another way (``build_app``).
    """
    return close_on_shutdown(app, ctx.aclose)

def instance_at(
    name: str, kind: Any, implementation: str, settings: ServerConfig, url: str
) -> ServerInstance:
    parsed = httpx.URL(url)
    placed = settings.model_copy(update={"host": parsed.host, "port": parsed.port})
    return ServerInstance(name, kind, implementation, placed)

def mesh_of(instances: list[ServerInstance], checkpoint: CheckpointConfig) -> MeshConfig:
    return MeshConfig(HeadServerConfig.model_validate({}), checkpoint, {i.name: i for i in instances}, raw={})

@dataclass
class Stack:
    """The server under test, its URL, and what the test needs to drive it."""

    app: Any
    url: str
    server: Any
    hooks: DataHooks
    helpers: dict[str, httpx.AsyncClient] = field(default_factory=dict)

@asynccontextmanager
async def under_test(stack: Stack, placement: Placement, root: Path, clock: Clock, token: str) -> AsyncIterator[
        ParticipantUnderTest]:
    """The stack's server as the conformance suite's ``ParticipantUnderTest``."""
    fake = clock if isinstance(clock, FakeClock) else None
    async with placement.client(stack.url) as client:
        yield ParticipantUnderTest(
            client, token, root, now=clock.now, advance_clock=fake.advance if fake else None,
            data=stack.hooks,
        )
