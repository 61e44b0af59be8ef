"""The simple agent's ``POST /run`` under checkpointing: a checkpoint that lands after its verify
(while it closes the resources session) keeps the verdict, and the restored ``/run`` answers from
it: every step runs once. Also the ``/run`` state's checks (``check_agent_state``)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import orjson
import pytest
from fastapi import FastAPI, Request, Response

from agents.simple_agent import app as agent_app
from agents.simple_agent.loop import LoopState
from nemo_gym_ckpt.config import CheckpointConfig, ServerConfig
from nemo_gym_ckpt.config import ServerRef as Ref
from nemo_gym_ckpt.context import ServerContext
from nemo_gym_ckpt.server import create_app
from nemo_gym_ckpt.testing.clock import FakeClock
from nemo_gym_ckpt.testing.conformance import Control, ParticipantUnderTest
from nemo_gym_ckpt.testing.placement import InProcess, Stack, closing_ctx, instance_at, mesh_of, under_test
from nemo_gym_ckpt.testing.placement import checkpoint_config as kit_checkpoint_config
from nemo_gym_ckpt.testing.scripted_model import ScriptedModel, message

pytestmark = pytest.mark.unit

TOKEN = "agent-run-token-4321"
WAIT_S = 10.0


def checkpoint_config(root: Path) -> CheckpointConfig:
    return kit_checkpoint_config(root, TOKEN)

ROW = {"responses_create_params": {"input": "What is 1+1?"}, "expected": "2"}


class Resources:
    """A resources server whose verify is not idempotent (it numbers its verdicts) and whose
    ``/close_session`` can be held."""

    def __init__(self, *, hold_close: bool) -> None:
        self.seeds = self.verifies = self.closes = 0
        self.hold_close = hold_close
        self.close_arrived = asyncio.Event()
        self.release_close = asyncio.Event()

    def app(self) -> FastAPI:
        app = create_app("calculator_tools")

        async def seed(request: Request) -> Response:
            self.seeds += 1
            reply = Response(orjson.dumps({"resources_session_id": "s1"}), media_type="application/json")
            reply.set_cookie("ng_session_calculator_tools", "s1")
            return reply

        async def verify(request: Request) -> dict[str, Any]:
            self.verifies += 1
            return {**await request.json(), "reward": 1.0, "verdict_number": self.verifies}  # echoes its request

        async def close(request: Request) -> dict[str, Any]:
            self.closes += 1
            self.close_arrived.set()
            if self.hold_close:
                await self.release_close.wait()
            return {"closed": True}

        app.add_api_route("/seed_session", seed, methods=["POST"])
        app.add_api_route("/verify", verify, methods=["POST"])
        app.add_api_route("/close_session", close, methods=["POST"])
        return app


@asynccontextmanager
async def run_agent(root: Path, clock: FakeClock, resources: Resources, model_app: FastAPI | None = None,
                    ) -> AsyncIterator[tuple[ParticipantUnderTest, ScriptedModel]]:
    """The simple agent (checkpointing on) over ``resources`` and a scripted model answering at once
    (or ``model_app``, when given)."""
    placement = InProcess()
    async with AsyncExitStack() as stack:
        model = ScriptedModel(lambda body: [message("2")])
        model_url = await stack.enter_async_context(placement.run(model_app or model.app()))
        resources_url = await stack.enter_async_context(placement.run(resources.app()))
        settings = agent_app.Config(model_server=Ref(type="responses_api_models", name="policy_model"),
                                    resources_server=Ref(type="resources_servers", name="calculator_tools"))
        mesh = mesh_of([
            instance_at("agent", "responses_api_agents", "simple_agent", settings, "http://127.0.0.1:1"),
            instance_at("policy_model", "responses_api_models", "scripted", ServerConfig(), model_url),
            instance_at("calculator_tools", "resources_servers", "calculator_tools", ServerConfig(), resources_url),
        ], checkpoint_config(root))
        ctx = ServerContext("agent", settings, mesh, placement.mesh_client())
        app = closing_ctx(agent_app.create_app(ctx, clock=clock), ctx)
        url = await stack.enter_async_context(placement.run(app))
        pt = await stack.enter_async_context(under_test(Stack(app, url, model, None), placement, root, clock, TOKEN))
        yield pt, model


async def test_a_checkpoint_after_verify_keeps_the_verdict_and_the_restored_run_does_not_verify_again(
    root: Path,
) -> None:
    clock = FakeClock(start=1_700_000_000.0)
    directory = root / "c1"
    first = Resources(hold_close=True)
    async with run_agent(root, clock, first) as (pt, _):
        control = Control(pt)
        run = asyncio.create_task(pt.client.post("/ng-rollout/r/run", json=ROW))
        await asyncio.wait_for(first.close_arrived.wait(), WAIT_S)  # verified; closing the resources session
        prepared = await control.ok("prepare", checkpoint_id="c1")
        assert prepared["report"]["ready"] is True  # the close may run again: it blocks nothing
        await control.ok("commit", checkpoint_id="c1", checkpoint_dir=str(directory),
                         episode_ids=[{"rollout_id": "r"}])
        run.cancel()  # the crash
        first.release_close.set()
    assert (first.seeds, first.verifies, first.closes) == (1, 1, 1)

    second = Resources(hold_close=False)
    async with run_agent(root, clock, second) as (pt, model):
        control = Control(pt)
        await control.ok("restore", checkpoint_id="back", checkpoint_dir=str(directory),
                         episode_ids=[{"rollout_id": "r"}])
        await control.ok("resume", checkpoint_id="back")
        reply = await pt.client.post("/ng-rollout/r-a1/run", json=ROW)
        assert reply.status_code == 200, reply.text
        row = reply.json()
    assert second.verifies == 0  # the verify ran once for the rollout
    assert (row["reward"], row["verdict_number"], row["expected"]) == (1.0, 1, "2")  # the first verify's verdict
    assert row["responses_create_params"] == ROW["responses_create_params"]  # its echoes put back
    assert row["response"]["output"][0]["type"] == "message"
    assert (second.seeds, len(model.calls), second.closes) == (0, 0, 1)  # no seed or model call again; closed
    # the record kept the verdict, without its echoes of the row and the response
    records = [orjson.loads(line) for path in directory.rglob("records-*.jsonl")
               for line in path.read_bytes().splitlines()]
    [state] = [record["session"]["running"]["state"] for record in records]
    assert state["stop_reason"] == "answer" and state["verdict"]["verdict_number"] == 1
    assert {"responses_create_params", "response"} <= set(state["verdict_echoes"])  # not written twice
    assert state["verdict"]["responses_create_params"] is None


def a_verified_state() -> dict[str, Any]:
    loop = LoopState([{"role": "user", "content": "1+1?"}], {}, 4, stop_reason="answer")
    run = agent_app.RunState(loop)
    request = {**ROW, "response": agent_app.response_object(loop)}
    run.verified({**request, "reward": 0.5}, request)
    return orjson.loads(orjson.dumps(run.view()))


def test_a_verified_run_state_is_checked_and_resumed_with_its_verdict() -> None:
    state = a_verified_state()
    agent_app.check_agent_state(state)
    params = agent_app.AgentRequest.model_validate(ROW["responses_create_params"])
    run = agent_app.resumed_run_state(state, params)
    request = {**ROW, "response": agent_app.response_object(run.loop)}
    assert run.restored_verdict(request) == {**request, "reward": 0.5}


@pytest.mark.parametrize("change", [
    lambda s: s.pop("verdict_echoes"),
    lambda s: s.update(stop_reason=None),
    lambda s: s["verdict"].pop("reward"),
    lambda s: s["verdict"].update(reward=True),
    lambda s: s.update(verdict_echoes=["reward"]),  # not null in the verdict
    lambda s: s.update(verdict_echoes=["absent"]),
])
def test_a_malformed_verdict_in_a_run_state_is_refused(change: Any) -> None:
    state = a_verified_state()
    change(state)
    with pytest.raises(ValueError):
        agent_app.check_agent_state(state)
