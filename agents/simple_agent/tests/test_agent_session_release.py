"""With checkpointing on, NeMo Gym's agent sessions of the simple agent (``SimpleAgent.agent_sessions``)
end with their episodes: a retire drops those of the retired attempts and the earlier ones of those
rollouts, a forget every one of those rollouts, as the checkpoint sessions are dropped."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from agents.simple_agent import app as agent_app
from nemo_gym_ckpt.config import CheckpointConfig, ServerConfig
from nemo_gym_ckpt.config import ServerRef as Ref
from nemo_gym_ckpt.context import ServerContext
from nemo_gym_ckpt.testing.clock import FakeClock
from nemo_gym_ckpt.testing.conformance import Control, ParticipantUnderTest
from nemo_gym_ckpt.testing.placement import InProcess, Stack, closing_ctx, instance_at, mesh_of, under_test
from nemo_gym_ckpt.testing.placement import checkpoint_config as kit_checkpoint_config
from nemo_gym_ckpt.testing.scripted_model import ScriptedModel, message

pytestmark = pytest.mark.unit

TOKEN = "agent-run-token-4321"


def checkpoint_config(root: Path) -> CheckpointConfig:
    return kit_checkpoint_config(root, TOKEN)


@asynccontextmanager
async def agent_under_test(root: Path) -> AsyncIterator[tuple[ParticipantUnderTest, agent_app.SimpleAgent]]:
    clock = FakeClock(start=1_700_000_000.0)
    placement = InProcess()
    async with AsyncExitStack() as stack:
        model = ScriptedModel(lambda body: [message("2")])
        model_url = await stack.enter_async_context(placement.run(model.app()))
        settings = agent_app.Config(model_server=Ref(type="responses_api_models", name="policy_model"))
        mesh = mesh_of([
            instance_at("agent", "responses_api_agents", "simple_agent", settings, "http://127.0.0.1:1"),
            instance_at("policy_model", "responses_api_models", "scripted", ServerConfig(), model_url),
        ], checkpoint_config(root))
        ctx = ServerContext("agent", settings, mesh, placement.mesh_client())
        agent = agent_app.SimpleAgent(ctx)
        app = closing_ctx(agent_app.build_app(agent, ctx, clock=clock), ctx)
        url = await stack.enter_async_context(placement.run(app))
        yield await stack.enter_async_context(under_test(Stack(app, url, model, None), placement, root, clock,
                                                         TOKEN)), agent


def seed_body(session_id: str, episode_id: dict[str, Any]) -> dict[str, Any]:
    return {"agent_session_id": session_id, "episode_id": episode_id, "task_id": {"t": "1"},
            "tool_accesses": [{"kind": "direct_http", "name": "tools", "required": True,
                               "base_url": "http://127.0.0.1:9/x", "cookies": {"c": "v"}}]}


async def test_retire_and_forget_drop_the_agent_sessions_of_their_episodes(root: Path) -> None:
    episodes = {"as-r1": {"rollout_id": "r1"}, "as-r1-a1": {"rollout_id": "r1", "attempt": 1},
                "as-r1-a2": {"rollout_id": "r1", "attempt": 2}, "as-r2": {"rollout_id": "r2"},
                "as-r3": {"rollout_id": "r3"}}
    async with agent_under_test(root) as (pt, agent):
        control = Control(pt)
        for session_id, episode_id in episodes.items():
            reply = await pt.client.post("/v1/agent_sessions", json=seed_body(session_id, episode_id))
            assert reply.status_code == 200, reply.text
        pt.client.cookies.clear()
        pt.client.cookies.set(agent.agent_cookie, "as-r2")  # an activation of that session
        reply = await pt.client.post("/ng-rollout/r2/v1/responses", json={"input": "hi"},
                                     headers={"x-ng-agent-activation": "1"})
        assert reply.status_code == 200, reply.text
        assert sorted(agent.agent_sessions.live) == sorted(episodes)

        await control.ok("retire", checkpoint_id="h1", episode_ids=[{"rollout_id": "r1", "attempt": 1}])
        assert sorted(agent.agent_sessions.live) == ["as-r1-a2", "as-r2", "as-r3"]  # attempts 0 and 1 of r1
        await control.ok("forget", checkpoint_id="h2", rollout_ids=["r1", "r2"])
        assert sorted(agent.agent_sessions.live) == ["as-r3"]
        assert sorted(agent.checkpoint.sessions if agent.checkpoint else ()) == []

        close = {"agent_session_id": "as-r2", "episode_id": {"rollout_id": "r2"}}
        reply = await pt.client.post("/v1/agent_sessions/close", json=close)  # as for an unknown id
        assert reply.status_code == 200 and reply.json()["resources_cookies"] is None, reply.text
