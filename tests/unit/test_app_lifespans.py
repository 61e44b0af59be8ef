"""Apps close what they hold when they shut down: ``close_on_shutdown`` and every server's client.

``close_on_shutdown`` chains a close onto an app's lifespan (after the app's own shutdown, in
order of registration, also when startup fails). Every server's ``create_app(ctx)`` closes
``ctx.client`` in the app's own lifespan, so an app entered in a test (over ``ASGITransport``) or
served by uvicorn closes its client; the client here runs over a transport that records its close.
"""

from __future__ import annotations

import importlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from model_servers.inference_worker.tests.scripted_engine import ScriptedEngine
from nemo_gym_ckpt.client import MeshClient
from nemo_gym_ckpt.config import load_config_dict
from nemo_gym_ckpt.context import ServerContext
from nemo_gym_ckpt.server import close_on_shutdown, create_app

pytestmark = pytest.mark.unit


class ClosingTransport(httpx.AsyncBaseTransport):
    """A transport that serves nothing and records that its client closed it."""

    def __init__(self) -> None:
        self.closed = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        return httpx.Response(503)

    async def aclose(self) -> None:
        self.closed += 1


def app_with_lifespan(events: list[str], *, fail_startup: bool = False) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        events.append("startup")
        if fail_startup:
            raise RuntimeError("startup failed")
        yield
        events.append("app shutdown")

    return create_app("app", lifespan=lifespan)


def closer(events: list[str], name: str) -> Any:
    async def aclose() -> None:
        events.append(name)

    return aclose


async def test_closes_run_after_the_apps_own_shutdown_in_order_of_registration() -> None:
    events: list[str] = []
    app = close_on_shutdown(close_on_shutdown(app_with_lifespan(events), closer(events, "participant")),
                            closer(events, "client"))
    async with app.router.lifespan_context(app):
        assert events == ["startup"]
    assert events == ["startup", "app shutdown", "participant", "client"]


async def test_closes_run_when_startup_fails() -> None:
    events: list[str] = []
    app = close_on_shutdown(app_with_lifespan(events, fail_startup=True), closer(events, "client"))
    with pytest.raises(RuntimeError, match="startup failed"):
        async with app.router.lifespan_context(app):
            pass
    assert events == ["startup", "client"]


REFS = {"agent_server": {"type": "responses_api_agents", "name": "agent"},
        "resources_server": {"type": "resources_servers", "name": "calculator_tools"},
        "model_server": {"type": "responses_api_models", "name": "policy_model"}}
SERVERS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "single_agent_turn": ("environment_servers", "single_agent_turn",
                          {"agent_server": REFS["agent_server"], "resources_server": REFS["resources_server"]}),
    "nim": ("environment_servers", "nim", {"agent_server": REFS["agent_server"]}),
    "agent": ("responses_api_agents", "simple_agent", {"model_server": REFS["model_server"]}),
    "restart_only_agent": ("responses_api_agents", "restart_only_agent", {"model_server": REFS["model_server"]}),
    "policy_model": ("responses_api_models", "policy_model",
                     {"upstream": {"base_url": "http://127.0.0.1:9/v1", "model": "m"}}),
    "inference_worker": ("responses_api_models", "inference_worker", {}),
    **{name: ("resources_servers", name, {})
       for name in ("calculator_tools", "kv_store", "math_verify", "mcqa", "python_repl", "string_match")},
}


@pytest.mark.parametrize("name", sorted(SERVERS))
async def test_every_servers_app_closes_its_client_when_it_shuts_down(name: str) -> None:
    raw: dict[str, Any] = {instance: {kind: {implementation: settings}}
                           for instance, (kind, implementation, settings) in SERVERS.items()}
    mesh = load_config_dict(raw)
    transport = ClosingTransport()
    ctx: ServerContext[Any] = ServerContext(name, mesh.instance(name).settings, mesh, MeshClient(transport=transport))
    module = importlib.import_module(mesh.instance(name).module)
    if name == "inference_worker":
        async def engine(_: Any) -> ScriptedEngine:
            return ScriptedEngine([5])

        app = module.create_app(ctx, engine_factory=engine)
    else:
        app = module.create_app(ctx)
    async with app.router.lifespan_context(app):
        assert transport.closed == 0
    assert transport.closed == 1
