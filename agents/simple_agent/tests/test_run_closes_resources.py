"""A seeded ``/run`` closes its resources session however it ends: answered, or failed in its loop or
its verify. With checkpointing on, a ``/run`` whose attempt ended (a retire cancels it) leaves the
session to the resources server and to the checkpoint that may continue the rollout."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from agents.simple_agent import app as agent_app
from agents.simple_agent.tests.test_checkpointed_run import ROW, WAIT_S, Resources, run_agent
from nemo_gym_ckpt.config import ServerConfig, ServerRef
from nemo_gym_ckpt.errors import Unavailable
from nemo_gym_ckpt.identity import RolloutIdentity
from nemo_gym_ckpt.server import create_app
from nemo_gym_ckpt.testing.clock import FakeClock
from nemo_gym_ckpt.testing.conformance import Control
from nemo_gym_ckpt.testing.scripted_model import ScriptedModel, message
from nemo_gym_ckpt.testing.transports import InProcessMesh
from resources_servers.kv_store import app as kv_app

pytestmark = pytest.mark.unit

KV_ROW = {"responses_create_params": {"input": "store nothing"}, "initial_state": {"k": "v"},
          "expected_state": {"k": "v"}}


def engine_down() -> FastAPI:
    """A policy model whose every call is 503 ``unavailable``."""
    app = create_app("policy_model")

    async def responses() -> dict[str, Any]:
        raise Unavailable("engine down")

    app.add_api_route("/v1/responses", responses, methods=["POST"])
    return app


def kv_mesh(model: FastAPI) -> tuple[InProcessMesh, kv_app.KvStore]:
    mesh = InProcessMesh({
        "policy_model": ("responses_api_models", "scripted", ServerConfig()),
        "kv": ("resources_servers", "kv_store", kv_app.Config()),
        "simple_agent": ("responses_api_agents", "simple_agent", agent_app.Config(
            model_server=ServerRef(type="responses_api_models", name="policy_model"),
            resources_server=ServerRef(type="resources_servers", name="kv"))),
    })
    mesh.serve("policy_model", model)
    kv = kv_app.KvStore(mesh.context("kv"))
    mesh.serve("kv", kv.build_app())
    mesh.build("simple_agent", agent_app.create_app)
    return mesh, kv


async def run(mesh: InProcessMesh, rollout: str) -> httpx.Response:
    return await mesh.client().request("POST", mesh.url_of("simple_agent") + "/run", json=KV_ROW,
                                       identity=RolloutIdentity(rollout), check=False)


async def test_a_run_whose_model_fails_closes_its_resources_session() -> None:
    mesh, kv = kv_mesh(engine_down())
    for rollout in ("r1", "r2", "r3"):
        reply = await run(mesh, rollout)
        assert reply.status_code == 503 and reply.json()["error"]["code"] == "unavailable"  # the loop's error
    assert len(kv.sessions) == 0  # all three seeded, all three closed
    await mesh.aclose()


async def test_a_run_whose_verify_fails_closes_its_resources_session() -> None:
    mesh, kv = kv_mesh(ScriptedModel(lambda body: [message("done")]).app())
    reply = await mesh.client().request("POST", mesh.url_of("simple_agent") + "/run",
                                        json={**KV_ROW, "expected_state": "not a store"},
                                        identity=RolloutIdentity("r1"), check=False)
    assert reply.status_code == 400, reply.text  # the resources server refused the verify request
    assert len(kv.sessions) == 0
    reply = await run(mesh, "r2")
    assert reply.status_code == 200 and reply.json()["reward"] == 1.0
    assert len(kv.sessions) == 0
    await mesh.aclose()


async def test_with_checkpointing_a_failed_run_closes_its_session(root: Path) -> None:
    resources = Resources(hold_close=False)
    async with run_agent(root, FakeClock(start=1_700_000_000.0), resources, engine_down()) as (pt, _):
        reply = await pt.client.post("/ng-rollout/r/run", json=ROW)
        assert reply.status_code == 503, reply.text
        assert (resources.seeds, resources.closes) == (1, 1)  # invoked again, it seeds afresh
        reply = await pt.client.post("/ng-rollout/r/run", json=ROW)
        assert reply.status_code == 503, reply.text
        assert (resources.seeds, resources.closes) == (2, 2)


class HeldVerify(Resources):
    """``Resources`` whose ``/verify`` waits until released."""

    def __init__(self) -> None:
        super().__init__(hold_close=False)
        self.verify_arrived = asyncio.Event()
        self.release_verify = asyncio.Event()

    def app(self) -> FastAPI:
        app = super().app()
        app.router.routes = [route for route in app.router.routes if getattr(route, "path", "") != "/verify"]

        async def verify() -> dict[str, Any]:
            self.verify_arrived.set()
            await self.release_verify.wait()
            return {"reward": 1.0}

        app.add_api_route("/verify", verify, methods=["POST"])
        return app


async def test_with_checkpointing_a_run_retired_mid_rollout_leaves_its_session_alone(root: Path) -> None:
    resources = HeldVerify()
    async with run_agent(root, FakeClock(start=1_700_000_000.0), resources) as (pt, _):
        pending = asyncio.create_task(pt.client.post("/ng-rollout/r/run", json=ROW))
        await asyncio.wait_for(resources.verify_arrived.wait(), WAIT_S)
        await Control(pt).ok("retire", checkpoint_id="h1", episode_ids=[{"rollout_id": "r", "attempt": 0}])
        reply = await asyncio.wait_for(pending, WAIT_S)
        resources.release_verify.set()
    assert reply.status_code == 409 and reply.json()["error"]["code"] == "stale_attempt"
    assert (resources.seeds, resources.closes) == (1, 0)
