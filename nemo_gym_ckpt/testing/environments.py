"""Driving an environment server under test: ``GateAgent`` and ``EnvHooks``.

``GateAgent`` implements an agent's routes (``/v1/responses``, ``/close``) and holds each activation
until its capture key is released (``/_test/release/<key>``, ``/_test/release_all``); a key *armed*
(``/_test/arm/<key>``) answers at once and holds ``/close`` instead; ``GET /_test/waiting`` lists
what is held. ``EnvHooks`` are the conformance suite's ``DataHooks`` over an environment whose agent
is a gate: ``request`` starts a ``/run`` in the background and returns once the episode is live
(held inside its agent activation, a replay step) or the ``/run`` was answered (a refusal);
``block`` keeps the episode inside ``close_agent`` (a wait step: the gate agent never says its close
may run again). The task rows come from the
``row`` callable the test passes (the environment's own row shape).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import FastAPI, Request

from nemo_gym_ckpt.identity import RolloutIdentity, current_identity
from nemo_gym_ckpt.server import create_app
from nemo_gym_ckpt.testing.scripted_model import message
from nemo_gym_ckpt.testing.waits import until

__all__ = ["WAIT_S", "EnvHooks", "GateAgent", "Row"]

WAIT_S = 10.0
Row = Callable[..., dict[str, Any]]
"""``row(payload=None)``: a task row of the environment under test carrying ``payload``."""


@dataclass
class _Gates:
    events: dict[str, asyncio.Event] = field(default_factory=dict)
    released: set[str] = field(default_factory=set)
    everything: bool = False

    def gate(self, key: str) -> asyncio.Event:
        event = self.events.setdefault(key, asyncio.Event())
        if self.everything or key in self.released:
            event.set()
        return event

class GateAgent:
    """The agent's routes, holding each activation (or, for armed keys, each close) until released."""

    def __init__(self, answer: str = "The answer is 1. I take 1.") -> None:
        self.answer = answer
        self.gates = _Gates()
        self.armed: set[str] = set()
        self.waiting: Counter[tuple[str, str]] = Counter()
        self.activations: list[tuple[str, str | None]] = []
        self.closed: list[str] = []

    def app(self) -> FastAPI:
        app = create_app("gate_agent")
        app.add_api_route("/v1/responses", self._responses, methods=["POST"])
        app.add_api_route("/close", self._close, methods=["POST"])
        app.add_api_route("/_test/arm/{key}", self._arm, methods=["POST"])
        app.add_api_route("/_test/release/{key}", self._release, methods=["POST"])
        app.add_api_route("/_test/release_all", self._release_all, methods=["POST"])
        app.add_api_route("/_test/waiting", self._waiting, methods=["GET"])
        return app

    async def _held(self, route: str, key: str) -> None:
        self.waiting[(route, key)] += 1
        try:
            await self.gates.gate(key).wait()
        finally:
            self.waiting[(route, key)] -= 1

    async def _responses(self, request: Request) -> dict[str, Any]:
        key = _key()
        self.activations.append((key, request.headers.get("x-ng-agent-activation")))
        if key not in self.armed:
            await self._held("activation", key)
        return {"id": "resp_gate", "output": [message(self.answer)], "usage": None}

    async def _close(self) -> dict[str, bool]:
        key = _key()
        self.closed.append(key)
        if key in self.armed:
            await self._held("close", key)
        return {"closed": True}

    async def _arm(self, key: str) -> dict[str, str]:
        self.armed.add(key)
        return {"armed": key}

    async def _release(self, key: str) -> dict[str, str]:
        self.gates.released.add(key)
        self.gates.gate(key).set()
        return {"released": key}

    async def _release_all(self) -> dict[str, bool]:
        self.gates.everything = True
        for event in self.gates.events.values():
            event.set()
        return {"released": True}

    async def _waiting(self) -> dict[str, list[str]]:
        held_now = [pair for pair, count in self.waiting.items() if count > 0]
        return {route: sorted(key for r, key in held_now if r == route) for route in ("activation", "close")}

def _key() -> str:
    identity = current_identity()
    return identity.capture_key if identity is not None else "-"

class EnvHooks:
    """The conformance suite's data plane on an environment server over a ``GateAgent``."""

    def __init__(self, row: Row, agent: httpx.AsyncClient) -> None:
        self.row = row
        self.agent = agent
        self.runs: list[asyncio.Task[httpx.Response]] = []

    def start(self, client: httpx.AsyncClient, episode: RolloutIdentity, row: dict[str, Any]) -> asyncio.Task[
            httpx.Response]:
        run = asyncio.create_task(client.post(f"/ng-rollout/{episode.capture_key}/run", json=row))
        self.runs.append(run)
        return run

    async def request(
        self, client: httpx.AsyncClient, episode: RolloutIdentity, payload: dict[str, Any]
    ) -> httpx.Response:
        """Start a ``/run``: the refusal it answered, or 200 once its episode is live and held."""
        run = self.start(client, episode, self.row(payload))
        await self.until_waiting("activation", episode.capture_key, run)
        return run.result() if run.done() else httpx.Response(200, json={"live": episode.capture_key})

    async def block(self, client: httpx.AsyncClient, episode: RolloutIdentity, blocked: bool) -> None:
        key = episode.capture_key
        if blocked:
            (await self.agent.post(f"/_test/arm/{key}")).raise_for_status()
            run = self.start(client, episode, self.row())
            await self.until_waiting("close", key, run)
            assert not run.done(), f"the blocking run ended: {run.result().text}"
            return
        (await self.agent.post(f"/_test/release/{key}")).raise_for_status()

    async def until_waiting(self, route: str, key: str, run: asyncio.Task[httpx.Response]) -> None:
        async def held_or_answered() -> bool:
            return run.done() or key in (await self.agent.get("/_test/waiting")).json()[route]

        await until(held_or_answered, f"the {route} of {key} held", timeout_s=WAIT_S, interval_s=0.002)

    async def aclose(self) -> None:
        """Release every held call, let the runs end (bounded), cancel what is left."""
        (await self.agent.post("/_test/release_all")).raise_for_status()
        pending = [run for run in self.runs if not run.done()]
        if pending:
            await asyncio.wait(pending, timeout=WAIT_S)
        for run in pending:
            run.cancel()
        await asyncio.gather(*self.runs, return_exceptions=True)
