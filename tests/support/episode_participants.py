"""Environment and agent servers as checkpoint participants under test.

A *stack* is the server under test (checkpointing on) plus the plain servers it calls, placed
either in process (``InProcess``: every app behind one routing transport, no sockets) or on real
uvicorn servers (``Sockets``: the ``serve_app`` fixture). Both give a ``ParticipantUnderTest`` for
the conformance suite, with the kind's ``DataHooks``:

- environments (``single_agent_turn``, ``nim``) call ``GateAgent``, an agent that implements the
  agent's routes and holds each activation until its capture key is released
  (``/_test/release/<key>``, ``/_test/release_all``); a key *armed* (``/_test/arm/<key>``) answers
  at once and holds ``/close`` instead. ``EnvHooks.request`` starts a ``/run`` in the background
  and returns once the episode is live (held inside ``invoke_agent``/``act``, a replay step) or the
  ``/run`` was answered (a refusal); ``EnvHooks.block`` keeps the episode inside ``close_agent``,
  a wait step.
- agents (``simple_agent``, ``restart_only_agent``) call a scripted policy model and a
  calculator with a ``hold`` tool (``tests.support.resources_participants.held``).
  ``AgentHooks.request`` is one whole activation (the next index of the episode);
  ``AgentHooks.block`` holds an activation inside a tool call (``NotApplicable`` on a
  restart-only agent, which never blocks).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from fastapi import FastAPI, Request

from agents.restart_only_agent import app as restart_only_app
from agents.simple_agent import app as agent_app
from environment_servers.nim import app as nim_app
from environment_servers.single_agent_turn import app as sat_app
from nemo_gym_ckpt.checkpoint.clock import Clock
from nemo_gym_ckpt.client import MeshClient
from nemo_gym_ckpt.config import CheckpointConfig, HeadServerConfig, MeshConfig, ServerConfig, ServerInstance
from nemo_gym_ckpt.config import ServerRef as Ref
from nemo_gym_ckpt.context import ServerContext
from nemo_gym_ckpt.identity import RolloutIdentity, current_identity
from nemo_gym_ckpt.resources.base import ResourcesServer
from nemo_gym_ckpt.server import close_on_shutdown, create_app
from nemo_gym_ckpt.testing.clock import FakeClock
from nemo_gym_ckpt.testing.conformance import NotApplicable, ParticipantUnderTest
from nemo_gym_ckpt.testing.scripted_model import ScriptedModel, function_call, last_user_text, message
from nemo_gym_ckpt.testing.transports import RoutingTransport
from resources_servers.calculator_tools import app as calculator_app
from tests.support.resources_participants import held

__all__ = [
    "ENVIRONMENTS",
    "TOKEN",
    "WAIT_S",
    "AgentHooks",
    "EnvHooks",
    "GateAgent",
    "InProcess",
    "Placement",
    "Sockets",
    "Stack",
    "agent_stack",
    "checkpoint_config",
    "closing_ctx",
    "env_row",
    "env_stack",
    "hold_policy",
    "instance_at",
    "mesh_of",
    "under_test",
]

TOKEN = "episodes-token-4321"
WAIT_S = 10.0
ENVIRONMENTS = ("single_agent_turn", "nim")
_PORTS = itertools.count(23000)


def checkpoint_config(root: Path, grace_s: float = 600.0) -> CheckpointConfig:
    return CheckpointConfig(enabled=True, control_auth_token=TOKEN, root=root, lease_grace_seconds=grace_s)


# ---- placing apps -----------------------------------------------------------------------------


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
        return httpx.AsyncClient(base_url=url, timeout=30)


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
    return MeshConfig(HeadServerConfig(), checkpoint, {i.name: i for i in instances}, raw={})


@dataclass
class Stack:
    """The server under test, its URL, and what the test needs to drive it."""

    app: Any
    url: str
    server: Any
    hooks: EnvHooks | AgentHooks
    helpers: dict[str, httpx.AsyncClient] = field(default_factory=dict)


# ---- environments -----------------------------------------------------------------------------


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


def env_row(implementation: str, payload: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    """A task row of the environment; ``payload`` rides along as a field of the row."""
    question = [{"role": "user", "content": "Compute 0 + 1."}]
    row: dict[str, Any] = {"responses_create_params": {"input": question}, "payload": payload or {}, **extra}
    if implementation == "nim":
        row.setdefault("nim", {"stones": 1, "max_take": 1, "seed": 3})
    else:
        row.setdefault("expected_answer", 1)
    return row


class EnvHooks:
    """The conformance suite's data plane on an environment server over a ``GateAgent``."""

    def __init__(self, implementation: str, agent: httpx.AsyncClient) -> None:
        self.implementation = implementation
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
        run = self.start(client, episode, env_row(self.implementation, payload))
        await self.until_waiting("activation", episode.capture_key, run)
        return run.result() if run.done() else httpx.Response(200, json={"live": episode.capture_key})

    async def block(self, client: httpx.AsyncClient, episode: RolloutIdentity, blocked: bool) -> None:
        key = episode.capture_key
        if blocked:
            (await self.agent.post(f"/_test/arm/{key}")).raise_for_status()
            run = self.start(client, episode, env_row(self.implementation))
            await self.until_waiting("close", key, run)
            assert not run.done(), f"the blocking run ended: {run.result().text}"
            return
        (await self.agent.post(f"/_test/release/{key}")).raise_for_status()

    async def until_waiting(self, route: str, key: str, run: asyncio.Task[httpx.Response]) -> None:
        deadline = time.monotonic() + WAIT_S
        while key not in (await self.agent.get("/_test/waiting")).json()[route] and not run.done():
            assert time.monotonic() < deadline, f"the {route} of {key} was never held"
            await asyncio.sleep(0.002)

    async def aclose(self) -> None:
        """Release every held call, let the runs end (bounded), cancel what is left."""
        (await self.agent.post("/_test/release_all")).raise_for_status()
        pending = [run for run in self.runs if not run.done()]
        if pending:
            await asyncio.wait(pending, timeout=WAIT_S)
        for run in pending:
            run.cancel()
        await asyncio.gather(*self.runs, return_exceptions=True)


@asynccontextmanager
async def _calculator(
    placement: Placement, server_class: type[ResourcesServer[Any]] = calculator_app.CalculatorTools
) -> AsyncIterator[str]:
    """A plain calculator (checkpointing off), its context closed with it."""
    ctx = ServerContext("calculator_tools", calculator_app.Config(), mesh_of([], CheckpointConfig()),
                        placement.mesh_client())
    async with placement.run(closing_ctx(server_class(ctx).build_app(), ctx)) as url:
        yield url


def _env_module(implementation: str) -> Any:
    return {"single_agent_turn": sat_app, "nim": nim_app}[implementation]


def _env_settings(implementation: str, **settings: Any) -> ServerConfig:
    agent = Ref(type="agents", name="gate_agent")
    if implementation == "nim":
        return nim_app.Config(agent=agent, **settings)
    resources = Ref(type="resources_servers", name="calculator_tools")
    return sat_app.Config(agent=agent, resources_server=resources, **settings)


@asynccontextmanager
async def env_stack(
    implementation: str, placement: Placement, checkpoint: CheckpointConfig, clock: Clock,
    *, gate: GateAgent | None = None, resources_url: str | None = None, **settings: Any,
) -> AsyncIterator[Stack]:
    """An environment server (checkpointing as ``checkpoint`` says) over a gate agent and a calculator
    (or the resources server at ``resources_url``)."""
    gate = gate or GateAgent()
    async with AsyncExitStack() as stack:
        agent_url = await stack.enter_async_context(placement.run(gate.app()))
        calculator_url = resources_url or await stack.enter_async_context(_calculator(placement))
        mesh = mesh_of([
            instance_at("env", "environment_servers", implementation,
                        _env_settings(implementation, **settings), "http://127.0.0.1:1"),
            instance_at("gate_agent", "agents", "gate", ServerConfig(), agent_url),
            instance_at("calculator_tools", "resources_servers", "calculator_tools", calculator_app.Config(),
                      calculator_url),
        ], checkpoint)
        ctx = ServerContext("env", mesh.instance("env").settings, mesh, placement.mesh_client())
        app = closing_ctx(_env_module(implementation).create_app(ctx, clock=clock), ctx)
        url = await stack.enter_async_context(placement.run(app))
        agent = await stack.enter_async_context(placement.client(agent_url))
        hooks = EnvHooks(implementation, agent)
        stack.push_async_callback(hooks.aclose)
        yield Stack(app, url, gate, hooks, {"agent": agent})


# ---- agents -----------------------------------------------------------------------------------


def hold_policy(body: dict[str, Any]) -> list[dict[str, Any]]:
    """A model that asks for the ``hold`` tool when told to hold, and otherwise answers."""
    items = body["input"]
    if isinstance(items, list) and items and items[-1].get("type") == "function_call_output":
        return [message(f"held: {items[-1]['output']}")]
    text = last_user_text(body)
    return [function_call("hold", {})] if text.startswith("hold") else [message(f"noted {text}")]


class AgentHooks:
    """The conformance suite's data plane on an agent: whole activations, and one held in a tool call."""

    def __init__(self, resources: httpx.AsyncClient, *, restart_only: bool) -> None:
        self.resources = resources
        self.restart_only = restart_only
        self.next: Counter[str] = Counter()
        self.pending: dict[str, asyncio.Task[httpx.Response]] = {}

    async def activate(
        self, client: httpx.AsyncClient, episode: RolloutIdentity, text: str
    ) -> httpx.Response:
        key = episode.capture_key
        index = self.next[key] + 1
        response = await client.post(f"/ng-rollout/{key}/v1/responses", json={"input": text},
                                     headers={"x-ng-agent-activation": str(index)})
        if response.status_code == 200:
            self.next[key] = index
        return response

    async def request(
        self, client: httpx.AsyncClient, episode: RolloutIdentity, payload: dict[str, Any]
    ) -> httpx.Response:
        return await self.activate(client, episode, f"state {sorted(payload.items())}")

    async def block(self, client: httpx.AsyncClient, episode: RolloutIdentity, blocked: bool) -> None:
        if self.restart_only:
            raise NotApplicable("a restart-only agent never blocks a prepare")
        key = episode.capture_key
        if blocked:
            self.pending[key] = asyncio.create_task(self.activate(client, episode, "hold on"))
            await self.until_held(key)
            return
        (await self.resources.post(f"/_test/release/{key}")).raise_for_status()

    async def until_held(self, key: str) -> None:
        deadline = time.monotonic() + WAIT_S
        while key not in (await self.resources.get("/_test/held")).json():
            pending = self.pending.get(key)
            assert pending is None or not pending.done(), f"the held call ended: {pending.result().text}"
            assert time.monotonic() < deadline, f"the tool call of {key} was never held"
            await asyncio.sleep(0.002)

    async def aclose(self) -> None:
        """Release every held call and let the activations end (bounded; the rest are cancelled)."""
        for key in list(self.pending):
            (await self.resources.post(f"/_test/release/{key}")).raise_for_status()
        pending = [task for task in self.pending.values() if not task.done()]
        if pending:
            await asyncio.wait(pending, timeout=WAIT_S)
        for task in pending:
            task.cancel()
        await asyncio.gather(*self.pending.values(), return_exceptions=True)


HeldCalculator = held(calculator_app.CalculatorTools)


@asynccontextmanager
async def agent_stack(
    implementation: str, placement: Placement, checkpoint: CheckpointConfig, clock: Clock,
    *, model: Any = None, **settings: Any,
) -> AsyncIterator[Stack]:
    """An agent (checkpointing as ``checkpoint`` says) over a scripted model and a held calculator."""
    model = model or ScriptedModel(hold_policy)
    async with AsyncExitStack() as stack:
        model_url = await stack.enter_async_context(placement.run(model.app()))
        calculator_url = await stack.enter_async_context(_calculator(placement, HeldCalculator))
        agent_settings = agent_app.Config(
            model_server=Ref(type="model_servers", name="policy_model"),
            resources_server=Ref(type="resources_servers", name="calculator_tools"), **settings)
        mesh = mesh_of([
            instance_at("agent", "agents", implementation, agent_settings, "http://127.0.0.1:1"),
            instance_at("policy_model", "model_servers", "scripted", ServerConfig(), model_url),
            instance_at("calculator_tools", "resources_servers", "calculator_tools", calculator_app.Config(),
                      calculator_url),
        ], checkpoint)
        ctx = ServerContext("agent", agent_settings, mesh, placement.mesh_client())
        module = {"simple_agent": agent_app, "restart_only_agent": restart_only_app}[implementation]
        app = closing_ctx(module.create_app(ctx, clock=clock), ctx)
        url = await stack.enter_async_context(placement.run(app))
        resources = await stack.enter_async_context(placement.client(calculator_url))
        hooks = AgentHooks(resources, restart_only=implementation == "restart_only_agent")
        stack.push_async_callback(hooks.aclose)
        yield Stack(app, url, model, hooks, {"resources": resources})


@asynccontextmanager
async def under_test(stack: Stack, placement: Placement, root: Path, clock: Clock) -> AsyncIterator[
        ParticipantUnderTest]:
    """The stack's server as the conformance suite's ``ParticipantUnderTest``."""
    fake = clock if isinstance(clock, FakeClock) else None
    async with placement.client(stack.url) as client:
        yield ParticipantUnderTest(
            client, TOKEN, root, now=clock.now, advance_clock=fake.advance if fake else None,
            data=stack.hooks,
        )
