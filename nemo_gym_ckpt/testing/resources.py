"""Driving a resources server under test: the ``hold`` tool and ``ResourcesHooks``.

``held(server_class)`` is a test subclass of a real resources server with one extra tool, ``hold``,
that waits (on an ``asyncio.Event`` of its capture key) until ``POST /_test/release/<key>``;
``GET /_test/held`` lists the keys held now. It stands in for a long tool call, so a test can keep
a call in flight deterministically. ``ResourcesHooks`` are the conformance suite's ``DataHooks``
over plain HTTP: ``request`` seeds a session, ``block`` holds a tool call open (and raises
``NotApplicable`` on a restart-only server, where nothing ever blocks).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import FastAPI

from nemo_gym_ckpt.checkpoint.clock import SYSTEM_CLOCK, Clock
from nemo_gym_ckpt.config import MeshConfig, load_config_dict
from nemo_gym_ckpt.identity import RolloutIdentity, current_identity
from nemo_gym_ckpt.resources.base import ResourcesServer, ToolArgs, tool
from nemo_gym_ckpt.testing.conformance import NotApplicable
from nemo_gym_ckpt.testing.waits import until

__all__ = ["WAIT_S", "HoldArgs", "Holding", "Holds", "ResourcesHooks", "held", "mesh_with", "until_held"]

WAIT_S = 10.0


def mesh_with(implementation: str, name: str, checkpoint: dict[str, Any] | None,
              settings: dict[str, Any] | None = None) -> MeshConfig:
    """A mesh of one resources server ``name`` (with ``settings``); checkpointing on when ``checkpoint``
    is given."""
    raw: dict[str, Any] = {name: {"resources_servers": {implementation: dict(settings or {})}}}
    if checkpoint is not None:
        raw["checkpoint"] = checkpoint
    return load_config_dict(raw)

class HoldArgs(ToolArgs):
    pass

@dataclass
class Holds:
    """The gates of held calls, by capture key, and how many calls wait at each now."""

    gates: dict[str, asyncio.Event] = field(default_factory=dict)
    waiting: Counter[str] = field(default_factory=Counter)

    def gate(self, key: str) -> asyncio.Event:
        return self.gates.setdefault(key, asyncio.Event())

class Holding:
    """Mixin of a test subclass: the ``hold`` tool and its ``/_test`` routes."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.holds = Holds()

    @tool
    async def hold(self, args: HoldArgs) -> str:
        """Wait until the test releases this call (a stand-in for a long tool call)."""
        identity = current_identity()
        key = identity.capture_key if identity else "-"
        self.holds.waiting[key] += 1
        try:
            await self.holds.gate(key).wait()
        finally:
            self.holds.waiting[key] -= 1
        return "released"

    def build_app(self, *, clock: Clock = SYSTEM_CLOCK) -> FastAPI:
        app: FastAPI = super().build_app(clock=clock)  # type: ignore[misc]
        holds = self.holds

        async def release(key: str) -> dict[str, str]:
            holds.gate(key).set()
            return {"released": key}

        async def held_keys() -> list[str]:
            return sorted(key for key, count in holds.waiting.items() if count > 0)

        app.add_api_route("/_test/release/{key}", release, methods=["POST"])
        app.add_api_route("/_test/held", held_keys, methods=["GET"])
        return app

def held(server_class: type[ResourcesServer[Any]]) -> type[ResourcesServer[Any]]:
    """A test subclass of ``server_class`` with the ``hold`` tool."""
    return type(f"Held{server_class.__name__}", (Holding, server_class), {})

class ResourcesHooks:
    """The conformance suite's data plane on a resources server (a ``held`` subclass)."""

    def __init__(
        self, server_class: type[ResourcesServer[Any]], row: Callable[[dict[str, Any]], dict[str, Any]] = dict
    ) -> None:
        self.restart_only = server_class.checkpoint_mode == "restart_only"
        self.row = row
        self._pending: dict[str, asyncio.Task[httpx.Response]] = {}

    async def request(
        self, client: httpx.AsyncClient, episode: RolloutIdentity, payload: dict[str, Any]
    ) -> httpx.Response:
        return await client.post(f"/ng-rollout/{episode.capture_key}/seed_session", json=self.row(payload))

    async def block(self, client: httpx.AsyncClient, episode: RolloutIdentity, blocked: bool) -> None:
        if self.restart_only:
            raise NotApplicable("a restart-only server never blocks a prepare")
        key = episode.capture_key
        if blocked:
            self._pending[key] = asyncio.create_task(client.post(f"/ng-rollout/{key}/hold", json={}))
            await until_held(client, key, self._pending[key])
            return
        (await client.post(f"/_test/release/{key}")).raise_for_status()
        response = await asyncio.wait_for(self._pending.pop(key), WAIT_S)
        assert response.status_code == 200, response.text

async def until_held(client: httpx.AsyncClient, key: str, call: asyncio.Task[httpx.Response]) -> None:
    """Poll ``/_test/held`` (with a deadline) until the call of ``key`` is held in the tool."""
    async def held() -> bool:
        assert not call.done(), f"the held call ended: {call.result().text}"
        return key in (await client.get("/_test/held")).json()

    await until(held, f"the call of {key} held", timeout_s=WAIT_S, interval_s=0.002)
