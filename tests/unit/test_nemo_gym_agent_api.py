"""The simple agent's NeMo Gym 0.7 surface, in process (docs/nemo-gym.md, "Servers' API").

``POST /run`` (what NeMo Gym's ``legacy_agent`` relays): one whole rollout of a task row, its
identity read from the row's ``_ng_`` keys, answered as the verified row, with checkpointing off
and on (admitted, waiting while a checkpoint is open, its session exported by a commit). NeMo Gym's
agent sessions: ``/v1/agent_sessions`` names the tools a session uses (a ``direct_http`` access),
the activation under ``/ng-rollout/<key>/`` calls them there, the close answers the resources
cookies. The training-capture path asks for token ids. ``POST /aggregate_metrics``.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request, Response

from agents.simple_agent import app as agent_app
from model_servers.inference_worker.default_model_data import make_problem
from nemo_gym_ckpt.aggregate_metrics import aggregate_metrics
from nemo_gym_ckpt.capture import TOKEN_ARRAYS
from nemo_gym_ckpt.config import ServerConfig, ServerRef
from nemo_gym_ckpt.identity import RolloutIdentity, current_identity
from nemo_gym_ckpt.server import create_app
from nemo_gym_ckpt.testing.scripted_model import ScriptedModel, calculator_policy
from nemo_gym_ckpt.testing.transports import InProcessMesh
from resources_servers.calculator_tools import app as calculator_app
from tests.support.rollout_mesh import (
    DeterministicModel,
    RolloutMesh,
    calculator_answers,
    calculator_row,
    rollout_mesh,
)

pytestmark = pytest.mark.unit

PROBLEMS = [make_problem(random.Random(400 + seed)) for seed in range(3)]
WAIT_S = 10.0
EPISODE = {"rollout_id": "5-0", "attempt": 0}


def model(**kwargs: Any) -> DeterministicModel:
    return DeterministicModel(calculator_answers({p["question"]: p for p in PROBLEMS}), **kwargs)


async def post(mesh: RolloutMesh, path: str, body: Any, *, identity: RolloutIdentity | None = None,
               cookies: dict[str, str] | None = None) -> httpx.Response:
    return await mesh.client.request("POST", mesh.urls["agent"] + path, json=body, identity=identity,
                                     rollout_prefix=identity is not None, cookies=cookies, check=False,
                                     timeout_s=WAIT_S)


@pytest.mark.parametrize("checkpoint", [False, True])
async def test_run_is_one_whole_rollout_named_by_the_rows_keys(tmp_path: Path, checkpoint: bool) -> None:
    deterministic = model()
    task = calculator_row(PROBLEMS[0])
    async with rollout_mesh("single_agent_turn", tmp_path, deterministic, checkpoint=checkpoint) as mesh:
        body = {**task, "_ng_task_index": 5, "_ng_rollout_index": 0, "_ng_attempt_index": 1}
        reply = await post(mesh, "/run", body)
        assert reply.status_code == 200, reply.text
        row = reply.json()
        assert row["reward"] == 1.0 and row["expected_answer"] == task["expected_answer"]
        assert row["responses_create_params"] == task["responses_create_params"]
        assert not [key for key in row if key.startswith("_ng_")]
        output = row["response"]["output"]
        assert [item["type"] for item in output] == ["function_call", "function_call_output", "message"]
        assert all(name in output[0] for name in TOKEN_ARRAYS)  # the agent asks for token ids
        assert json.loads(row["response"]["metadata"]["policy_versions"]) == [0, 0]
        assert set(deterministic.capture_keys()) == {"5-0-a1"}
        refused = await post(mesh, "/run", {"no": "params"})
        assert (refused.status_code, refused.json()["error"]["code"]) == (400, "invalid_request")


async def test_run_waits_while_a_checkpoint_is_open_and_its_session_is_exported(tmp_path: Path) -> None:
    deterministic = model(hold=lambda key, body: len(body["input"]) > 1)  # hold the second model call
    async with rollout_mesh("single_agent_turn", tmp_path, deterministic) as mesh:
        coordinator = mesh.coordinator()
        deadline = time.time() + 60
        body = {**calculator_row(PROBLEMS[0]), "_ng_task_index": 1, "_ng_rollout_index": 0}
        running = asyncio.create_task(post(mesh, "/run", body))
        async with asyncio.timeout(WAIT_S):
            while deterministic.holding["1-0"] != 1:
                await asyncio.sleep(0.01)
        prepared = await coordinator.prepare("ck-run", deadline_ts=deadline)
        assert prepared.prepared, prepared.to_json()
        late = asyncio.create_task(post(mesh, "/run", {**body, "_ng_task_index": 2}))
        async with asyncio.timeout(WAIT_S):
            while (await mesh.status("agent"))["waiting_requests"] != 1:
                await asyncio.sleep(0.01)
        committed = await coordinator.commit("ck-run", deadline_ts=deadline, checkpoint_dir=str(tmp_path / "c1"))
        assert "1-0" in committed.episode_ids()
        await coordinator.resume("ck-run", deadline_ts=deadline)
        deterministic.release()
        first, second = await asyncio.wait_for(asyncio.gather(running, late), WAIT_S)
        assert (first.status_code, second.status_code) == (200, 200), (first.text, second.text)
        assert first.json()["reward"] == 1.0
        await coordinator.aclose()


@asynccontextmanager
async def tools_elsewhere(mesh: RolloutMesh) -> AsyncIterator[tuple[str, list[tuple[str, str, str]]]]:
    """A resources server other than the agent's own: it answers every tool call 42 and records it."""
    calls: list[tuple[str, str, str]] = []
    app: FastAPI = create_app("elsewhere")

    @app.post("/{tool}")
    async def any_tool(tool: str, request: Request) -> Response:
        identity = current_identity()
        calls.append((tool, identity.capture_key if identity else "-", request.cookies.get("res", "")))
        reply = Response("42", media_type="application/json")
        reply.set_cookie("res", "after")
        return reply

    async with mesh.placement.run(app) as url:
        yield url, calls


def seed_body(base_url: str, session_id: str = "agent-session-1") -> dict[str, Any]:
    access = {"kind": "direct_http", "name": "elsewhere.direct_http", "required": True, "base_url": base_url,
              "cookies": {"res": "before"}}
    return {"agent_session_id": session_id, "episode_id": EPISODE, "task_id": {"taskset": "t", "task_id": "5"},
            "tool_accesses": [access]}


@pytest.mark.parametrize("checkpoint", [False, True])
async def test_agent_sessions_name_the_tools_and_the_close_answers_their_cookies(
    tmp_path: Path, checkpoint: bool
) -> None:
    async with (rollout_mesh("single_agent_turn", tmp_path, model(), checkpoint=checkpoint) as mesh,
                tools_elsewhere(mesh) as (url, tool_calls)):
        seeded = await post(mesh, "/v1/agent_sessions", seed_body(url))
        assert (seeded.status_code, seeded.json()) == (200, {"agent_session_id": "agent-session-1"})
        cookies = dict(seeded.cookies.items())
        again = await post(mesh, "/v1/agent_sessions", seed_body(url))
        assert again.status_code == 200  # an identical seed is the same session
        other = await post(mesh, "/v1/agent_sessions", {**seed_body(url), "task_id": {"taskset": "t", "task_id": "6"}})
        assert (other.status_code, other.json()["error"]["code"]) == (400, "invalid_request")
        params = calculator_row(PROBLEMS[1])["responses_create_params"]
        activated = await post(mesh, "/v1/responses", params, identity=RolloutIdentity("5-0"), cookies=cookies)
        assert activated.status_code == 200, activated.text
        assert tool_calls == [(PROBLEMS[1]["tool"], "5-0", "before")]  # the session's tools, not the agent's
        assert activated.json()["output"][-1]["content"][0]["text"] == "The answer is 42."
        wrong = await post(mesh, "/v1/responses", params, identity=RolloutIdentity("9-0"), cookies=cookies)
        assert (wrong.status_code, wrong.json()["error"]["code"]) == (400, "invalid_request")
        close = {"agent_session_id": "agent-session-1", "episode_id": EPISODE}
        closed = await post(mesh, "/v1/agent_sessions/close", close, cookies=cookies)
        assert closed.status_code == 200, closed.text
        assert closed.json() == {"agent_session_id": "agent-session-1", "agent_observations": None,
                                 "resources_cookies": {"res": "after"}}
        assert (await post(mesh, "/v1/agent_sessions/close", close)).json() == closed.json()  # idempotent
        reseeded = await post(mesh, "/v1/agent_sessions", seed_body(url))
        assert (reseeded.status_code, reseeded.json()["error"]["code"]) == (400, "invalid_request")
        unknown = await post(mesh, "/v1/agent_sessions/close", {**close, "agent_session_id": "never"})
        assert unknown.json() == {"agent_session_id": "never", "agent_observations": None, "resources_cookies": None}
        for bad in ({**seed_body(url), "extra": 1}, {**seed_body(url), "agent_session_id": ""},
                    {**seed_body(url), "tool_accesses": [{"kind": "mcp", "name": "m", "required": True,
                                                          "connection": {}}]}):
            refused = await post(mesh, "/v1/agent_sessions", {**bad, "agent_session_id": bad["agent_session_id"]})
            assert (refused.status_code, refused.json()["error"]["code"]) == (400, "invalid_request"), bad


async def test_the_training_capture_path_asks_for_token_ids() -> None:
    """An agent without ``return_token_ids`` asks the policy model for them on NeMo Gym's capture path only."""
    scripted = ScriptedModel(calculator_policy({p["question"]: p for p in PROBLEMS}))
    mesh = InProcessMesh({
        "policy_model": ("responses_api_models", "scripted", ServerConfig()),
        "calculator_tools": ("resources_servers", "calculator_tools", calculator_app.Config()),
        "agent": ("responses_api_agents", "simple_agent", agent_app.Config(
            model_server=ServerRef(type="responses_api_models", name="policy_model"),
            resources_server=ServerRef(type="resources_servers", name="calculator_tools"))),
    })
    mesh.serve("policy_model", scripted.app())
    for name, module in (("calculator_tools", calculator_app), ("agent", agent_app)):
        mesh.build(name, module.create_app)
    client = mesh.client()
    params = calculator_row(PROBLEMS[2])["responses_create_params"]
    for path, key in (("/v1/responses", "3-0"), ("/training-token-capture/v1/responses", "4-0")):
        reply = await client.request("POST", mesh.url_of("agent") + path, json=params,
                                     identity=RolloutIdentity(key), check=False)
        assert reply.status_code == 200, reply.text
    asked = {(call.capture_key, bool(call.body.get("return_token_ids"))) for call in scripted.calls}
    assert asked == {("3-0", False), ("4-0", True)}
    await mesh.aclose()


async def test_the_agent_answers_aggregate_metrics(tmp_path: Path) -> None:
    rows = [{"_ng_task_index": t, "_ng_rollout_index": 0, "reward": float(t % 2)} for t in range(4)]
    async with rollout_mesh("single_agent_turn", tmp_path, model(), checkpoint=False) as mesh:
        reply = await post(mesh, "/aggregate_metrics", {"verify_responses": rows})
        assert reply.status_code == 200 and reply.json() == aggregate_metrics(rows)
