"""single_agent_turn in process: real agent, real calculator_tools, scripted policy model."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from agents.simple_agent import app as agent_app
from environment_servers.single_agent_turn import app as env_app
from model_servers.inference_worker.default_model_data import make_problem
from nemo_gym_ckpt.config import ServerConfig, ServerRef
from nemo_gym_ckpt.context import ServerContext
from nemo_gym_ckpt.environment.base import mount_run
from nemo_gym_ckpt.environment.episode import Boundary, Episode, Step
from nemo_gym_ckpt.errors import InternalError
from nemo_gym_ckpt.identity import RolloutIdentity, current_identity
from nemo_gym_ckpt.server import create_app
from nemo_gym_ckpt.testing.scripted_model import ScriptedModel, calculator_policy, function_call, message
from nemo_gym_ckpt.testing.tally import Tally
from nemo_gym_ckpt.testing.transports import InProcessMesh
from resources_servers.calculator_tools import app as calculator_app

pytestmark = pytest.mark.unit

PROBLEMS = [make_problem(random.Random(seed)) for seed in range(3)]
TOOLS = [spec.definition() for spec in calculator_app.CalculatorTools.tool_specs.values()]
RID = RolloutIdentity("2-0")
STEPS = ["seed", "invoke_agent", "close_agent", "verify", "close_session", "return"]


def row(problem: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"responses_create_params": {"input": [{"role": "user", "content": problem["question"]}],
                                        "tools": TOOLS},
            "expected_answer": problem["answer"], "question_id": problem["template"], **extra}


def build_mesh(resources: str = "calculator_tools", **env: Any) -> tuple[InProcessMesh, ScriptedModel]:
    model = ScriptedModel(calculator_policy({p["question"]: p for p in PROBLEMS}))
    mesh = InProcessMesh({
        "policy_model": ("responses_api_models", "scripted", ServerConfig()),
        "calculator_tools": ("resources_servers", "calculator_tools", calculator_app.Config()),
        "tally": ("resources_servers", "tally", ServerConfig()),
        "simple_agent": ("responses_api_agents", "simple_agent", agent_app.Config(
            model_server=ServerRef(type="responses_api_models", name="policy_model"),
            resources_server=ServerRef(type="resources_servers", name=resources))),
        "env": ("environment_servers", "single_agent_turn", env_app.Config(
            agent_server=ServerRef(type="responses_api_agents", name="simple_agent"),
            resources_server=ServerRef(type="resources_servers", name=resources), **env)),
    })
    mesh.serve("policy_model", model.app())
    mesh.build("calculator_tools", calculator_app.create_app)
    return mesh, model


class Recorder:
    """Episode hooks that record each step's mode and each boundary."""

    def __init__(self) -> None:
        self.modes: list[tuple[str, str]] = []
        self.boundaries: list[dict[str, Any]] = []

    async def entering(self, episode: Episode, step: Step) -> None:
        self.modes.append((step.name, step.mode_for(episode.boundary.state())))

    async def at_boundary(self, episode: Episode) -> None:
        self.boundaries.append(episode.record())


def env_with_hooks(ctx: ServerContext[env_app.Config], hooks: Recorder) -> FastAPI:
    app = create_app(ctx.name)
    mount_run(app, env_app.SingleAgentTurn(ctx).program, ctx.settings, hooks=hooks)
    return app


@pytest.fixture
async def mesh() -> AsyncIterator[tuple[InProcessMesh, ScriptedModel, agent_app.SimpleAgent]]:
    built, model = build_mesh()
    agent = agent_app.SimpleAgent(built.context("simple_agent"))
    app = create_app("simple_agent")
    app.add_api_route("/v1/responses", agent.responses, methods=["POST"])
    app.add_api_route("/close", agent.close, methods=["POST"])
    built.serve("simple_agent", app)
    yield built, model, agent
    await built.aclose()


async def run(mesh: InProcessMesh, body: Any, identity: RolloutIdentity | None = RID) -> httpx.Response:
    return await mesh.client().request("POST", mesh.url_of("env") + "/run", json=body, identity=identity,
                                       check=False)


async def test_a_rollout_runs_every_step_and_answers_the_row(mesh: Any) -> None:
    built, model, agent = mesh
    hooks = Recorder()
    built.build("env", lambda ctx: env_with_hooks(ctx, hooks))
    task = row(PROBLEMS[0])
    reply = await run(built, task)
    assert reply.status_code == 200, reply.text
    result = reply.json()
    assert result["reward"] == 1.0 and result["extracted_answer"] == PROBLEMS[0]["answer"]
    assert {key: result[key] for key in task} == task  # the task row passes through unchanged
    assert [item["type"] for item in result["response"]["output"]] == [
        "function_call", "function_call_output", "message"]
    assert hooks.modes == [(name, "wait" if name == "close_agent" else "replay") for name in STEPS]
    assert [b["boundary"]["next_step"] for b in hooks.boundaries] == [*STEPS[1:], None]
    assert hooks.boundaries[0]["episode_id"] == {"rollout_id": "2-0", "attempt": 0}
    assert hooks.boundaries[0]["boundary"]["state"]["resources"]["verify_mode"] == "replay"
    assert {call.capture_key for call in model.calls} == {"2-0"}
    assert agent.sessions == {}  # close_agent freed the session


async def test_a_wrong_answer_gets_reward_zero(mesh: Any) -> None:
    built, model, _ = mesh
    built.build("env", env_app.create_app)
    model.policy = lambda body: [message("The answer is -1.")]
    result = (await run(built, row(PROBLEMS[1]))).json()
    assert result["reward"] == 0.0 and result["extracted_answer"] == -1


async def test_a_run_without_rollout_prefix_gets_its_own_identity(mesh: Any) -> None:
    built, model, _ = mesh
    built.build("env", env_app.create_app)
    reply = await run(built, row(PROBLEMS[2]), identity=None)
    assert reply.status_code == 200 and reply.json()["reward"] == 1.0
    keys = {call.capture_key for call in model.calls}
    assert len(keys) == 1 and next(iter(keys)).startswith("anon-")


@pytest.mark.parametrize(
    ("body", "detail"),
    [
        ({"expected_answer": 1}, "responses_create_params"),
        ({"responses_create_params": {"tools": []}}, "input"),
        ({"responses_create_params": "hi"}, "responses_create_params"),
        ([], "JSON object"),
        ("text", "JSON object"),
    ],
)
async def test_a_bad_task_row_is_a_400_before_any_step(mesh: Any, body: Any, detail: str) -> None:
    built, model, _ = mesh
    built.build("env", env_app.create_app)
    reply = await run(built, body)
    assert reply.status_code == 400 and reply.json()["error"]["code"] == "invalid_request"
    assert detail in reply.json()["error"]["detail"] and model.calls == []


async def test_invalid_json_body_is_a_400(mesh: Any) -> None:
    built, _, _ = mesh
    built.build("env", env_app.create_app)
    client = built.client()
    reply = await client._http.post(built.url_of("env") + "/run", content=b"{nope")
    assert reply.status_code == 400 and "not valid JSON" in reply.json()["error"]["detail"]


async def test_a_verify_refusal_names_the_step_and_closes_the_agent(mesh: Any) -> None:
    built, _, agent = mesh
    built.build("env", env_app.create_app)
    reply = await run(built, row(PROBLEMS[0], expected_answer="many"))
    assert reply.status_code == 400
    assert reply.json()["error"]["detail"].startswith("step verify failed: expected_answer")
    assert agent.sessions == {}


async def test_an_unreachable_agent_fails_invoke_agent(mesh: Any) -> None:
    built, _, _ = mesh
    built.build("env", env_app.create_app)
    built.transport.unmount(built.url_of("simple_agent"))
    reply = await run(built, row(PROBLEMS[0]))
    assert reply.status_code == 503 and reply.json()["error"]["code"] == "unavailable"
    assert reply.json()["error"]["detail"].startswith("step invoke_agent failed:")


class ContractAgent:
    """The agent's route contract, recording what the environment sent."""

    def __init__(self, answer: Any = None, status: int = 200) -> None:
        self.seen: list[dict[str, Any]] = []
        self.closed: list[str] = []
        self.answer = answer
        self.status = status

    def app(self) -> FastAPI:
        app = create_app("simple_agent")

        @app.post("/v1/responses")
        async def responses(request: Request) -> Any:
            identity = current_identity()
            self.seen.append({"key": identity.capture_key if identity else None, "body": await request.json(),
                              "activation": request.headers.get("x-ng-agent-activation"),
                              "cookies": dict(request.cookies)})
            if self.status >= 500:
                raise InternalError("agent bug")
            if self.answer == "hang":
                await asyncio.sleep(30)
            return self.answer or {"output": [message("The answer is 0.")], "usage": None}

        @app.post("/close")
        async def close() -> dict[str, bool]:
            identity = current_identity()
            self.closed.append(identity.capture_key if identity else "")
            return {"closed": True}

        return app


async def test_the_agent_gets_activation_1_the_params_and_the_resources_cookies() -> None:
    built, _ = build_mesh()
    contract = ContractAgent()
    built.serve("simple_agent", contract.app())
    built.build("env", env_app.create_app)
    task = row(PROBLEMS[0])
    assert (await run(built, task)).status_code == 200
    [seen] = contract.seen
    assert seen["key"] == "2-0" and seen["activation"] == "1"
    assert seen["body"] == task["responses_create_params"]
    assert list(seen["cookies"]) == ["ng_session_calculator_tools"]
    assert contract.closed == ["2-0"]
    await built.aclose()


@pytest.mark.parametrize(
    ("agent", "status", "code"),
    [(ContractAgent(status=500), 502, "upstream_error"), (ContractAgent(answer={"no": "output"}), 502,
                                                            "upstream_error"),
     (ContractAgent(answer={"output": [1]}), 502, "upstream_error"),
     (ContractAgent(answer={"output": [None]}), 502, "upstream_error"),
     (ContractAgent(answer={"output": ["text"]}), 502, "upstream_error")],
)
async def test_a_broken_agent_is_an_upstream_error_and_still_closed(
    agent: ContractAgent, status: int, code: str
) -> None:
    built, _ = build_mesh()
    built.serve("simple_agent", agent.app())
    built.build("env", env_app.create_app)
    reply = await run(built, row(PROBLEMS[0]))
    assert reply.status_code == status and reply.json()["error"]["code"] == code
    assert "step invoke_agent failed" in reply.json()["error"]["detail"]
    assert agent.closed == ["2-0"]
    await built.aclose()


async def test_the_episode_timeout_names_the_running_step() -> None:
    built, _ = build_mesh(default_episode_timeout_seconds=0.1)
    agent = ContractAgent(answer="hang")
    built.serve("simple_agent", agent.app())
    built.build("env", env_app.create_app)
    reply = await run(built, row(PROBLEMS[0]))
    assert reply.status_code == 504 and reply.json()["error"]["code"] == "upstream_timeout"
    assert "step invoke_agent failed: the episode timeout" in reply.json()["error"]["detail"]
    assert agent.closed == ["2-0"]
    await built.aclose()


async def test_a_stateful_resources_session_is_kept_verified_and_closed() -> None:
    built, model = build_mesh(resources="tally")
    tally = Tally(built.context("tally"))
    built.serve("tally", tally.build_app())
    built.build("simple_agent", agent_app.create_app)
    hooks = Recorder()
    built.build("env", lambda ctx: env_with_hooks(ctx, hooks))

    def policy(body: dict[str, Any]) -> list[dict[str, Any]]:
        done = sum(1 for item in body["input"] if item.get("type") == "function_call_output")
        return [function_call("bump", {"by": 5})] if done < 3 else [message("done")]

    model.policy = policy
    task = {"responses_create_params": {"input": "bump to 15"}, "target": 15}
    reply = await run(built, task)
    assert reply.status_code == 200, reply.text
    assert reply.json()["reward"] == 1.0 and reply.json()["tally"] == 15
    assert ("verify", "wait") in hooks.modes  # the tally server did not declare replay
    assert len(tally.sessions) == 0  # close_session freed it
    await built.aclose()


def test_verify_mode_follows_the_seed_answer() -> None:
    assert env_app.verify_mode({"resources": {"verify_mode": "replay"}}) == "replay"
    assert env_app.verify_mode({"resources": {"verify_mode": "wait"}}) == "wait"
    assert env_app.verify_mode({}) == "wait"


async def test_replies_are_kept_without_their_echoes_and_the_row_is_whole_again(mesh: Any) -> None:
    built, _, _ = mesh
    hooks = Recorder()
    built.build("env", lambda ctx: env_with_hooks(ctx, hooks))
    task = row(PROBLEMS[0])
    result = (await run(built, task)).json()
    at_return = next(b["boundary"] for b in hooks.boundaries if b["boundary"]["next_step"] == "return")
    state = at_return["state"]
    assert state["response_echoes"] == ["tools"] and state["response"]["tools"] is None  # the request's tools
    assert {"responses_create_params", "response"} <= set(state["verdict_echoes"])  # the verifier's echo of it all
    assert state["verdict"]["responses_create_params"] is None and state["verdict"]["response"] is None
    turn = env_app.SingleAgentTurn(built.context("env"))
    episode = Episode.from_boundary(RID.next_attempt(), task, Boundary.from_json(at_return), turn.program)
    await turn.finish(episode)  # the return step, as a restored episode runs it
    again = episode.state["result"]
    assert again == result  # the row a rollout answers is its final boundary's state (canonical JSON)
    assert again["responses_create_params"] == task["responses_create_params"] and again["response"]["tools"] == TOOLS
    assert set(episode.state) & {"verdict", "response", "verdict_echoes", "response_echoes"} == set()


async def test_an_agent_busy_after_the_seed_is_unavailable_not_a_refusal_up_front() -> None:
    """The agent's 429 came after the seed step ran: answering our own 429 would have the collector
    send the same attempt again as if nothing had started."""
    built, _ = build_mesh()
    agent = create_app("simple_agent")

    @agent.post("/v1/responses")
    async def busy() -> Any:
        return JSONResponse({"error": {"code": "capacity_exceeded", "detail": "busy"}}, status_code=429,
                            headers={"retry-after": "30"})

    @agent.post("/close")
    async def close() -> dict[str, bool]:
        return {"closed": True}

    built.serve("simple_agent", agent)
    built.build("env", env_app.create_app)
    reply = await run(built, row(PROBLEMS[0]))
    assert (reply.status_code, reply.json()["error"]["code"]) == (503, "unavailable")
    assert "retry-after" not in reply.headers
    assert reply.json()["error"]["detail"].startswith("step invoke_agent failed: a peer was busy")
    await built.aclose()
