"""The nim environment in process: the real simple agent and a scripted policy model."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request

from agents.simple_agent import app as agent_app
from environment_servers.nim import app as nim_app
from nemo_gym_ckpt.config import ServerConfig, ServerRef
from nemo_gym_ckpt.environment.base import mount_run
from nemo_gym_ckpt.environment.episode import Episode, Step
from nemo_gym_ckpt.identity import RolloutIdentity, current_identity
from nemo_gym_ckpt.server import create_app
from nemo_gym_ckpt.testing.scripted_model import ScriptedModel, message, nim_policy
from nemo_gym_ckpt.testing.transports import InProcessMesh

pytestmark = pytest.mark.unit

RID = RolloutIdentity("5-2")
RULES = "You play Nim. Take 1 to 3 stones; whoever takes the last stone wins."


def task(**rules: Any) -> dict[str, Any]:
    return {"responses_create_params": {"input": [{"role": "system", "content": RULES}], "temperature": 0.0},
            "nim": {"stones": 10, "max_take": 3, "seed": 4, "opponent_skill": 0.5, **rules}}


def build_mesh(**env: Any) -> tuple[InProcessMesh, ScriptedModel]:
    model = ScriptedModel(nim_policy)
    mesh = InProcessMesh({
        "policy_model": ("responses_api_models", "scripted", ServerConfig()),
        "simple_agent": ("responses_api_agents", "simple_agent", agent_app.Config(
            model_server=ServerRef(type="responses_api_models", name="policy_model"))),
        "nim": ("environment_servers", "nim",
                nim_app.Config(agent_server=ServerRef(type="responses_api_agents", name="simple_agent"), **env)),
    })
    mesh.serve("policy_model", model.app())
    mesh.build("simple_agent", agent_app.create_app)
    return mesh, model


@pytest.fixture
async def mesh() -> AsyncIterator[tuple[InProcessMesh, ScriptedModel]]:
    built, model = build_mesh()
    built.build("nim", nim_app.create_app)
    yield built, model
    await built.aclose()


async def run(mesh: InProcessMesh, body: Any) -> httpx.Response:
    url = mesh.url_of("nim") + "/run"
    return await mesh.client().request("POST", url, json=body, identity=RID, check=False)


async def test_a_perfect_player_wins_over_many_steps(mesh: Any) -> None:
    built, model = mesh
    reply = await run(built, task())
    assert reply.status_code == 200, reply.text
    result = reply.json()
    assert result["reward"] == 1.0 and result["winner"] == "agent" and result["invalid_actions"] == 0
    assert result["activations"] >= 2 and result["activations"] == len(model.calls)
    assert result["nim"] == task()["nim"]
    assert result["responses_create_params"] == task()["responses_create_params"]
    output = result["response"]["output"]
    assert output[0]["role"] == "user" and output[0]["content"] == "10 stones left. Take 1 to 3."
    assert output[-1]["content"].endswith("the last stone: you win.")
    assert result["response"]["usage"]["input_tokens"] == 10 * len(model.calls)
    # each activation sees the whole conversation so far, the agent's outputs verbatim
    last_input = model.calls[-1].body["input"]
    assert last_input[0] == task()["responses_create_params"]["input"][0]
    assert last_input[1:] == output[:-2]  # all but the last answer and the final observation
    assert all(call.body["temperature"] == 0.0 and call.capture_key == "5-2" for call in model.calls)


async def test_a_losing_player_gets_zero(mesh: Any) -> None:
    built, model = mesh
    model.policy = lambda body: [message("I take 1.")]
    result = (await run(built, task(opponent_skill=1.0, stones=9))).json()
    assert result["reward"] == 0.0 and result["winner"] == "opponent"


async def test_nonsense_answers_lose_after_max_invalid(mesh: Any) -> None:
    built, model = mesh
    model.policy = lambda body: [message("I would rather not.")]
    result = (await run(built, task(max_invalid=3))).json()
    assert result["winner"] == "opponent" and result["invalid_actions"] == 3 and result["activations"] == 3


async def test_max_turns_ends_an_unfinished_game() -> None:
    built, model = build_mesh(max_turns=2)
    built.build("nim", nim_app.create_app)
    model.policy = lambda body: [message("1")]
    result = (await run(built, task(stones=100, opponent_skill=0.0))).json()
    assert result["winner"] is None and result["reward"] == 0.0 and result["activations"] == 2
    await built.aclose()


@pytest.mark.parametrize(
    "body",
    [task(stones=0), task(max_take="lots"), {"responses_create_params": {"input": "x"}},
     {**task(), "responses_create_params": {}}],
)
async def test_bad_game_rows_are_400s(mesh: Any, body: dict[str, Any]) -> None:
    built, model = mesh
    reply = await run(built, body)
    assert reply.status_code == 400 and reply.json()["error"]["code"] == "invalid_request"
    assert model.calls == []


class Recorder:
    def __init__(self) -> None:
        self.games: list[dict[str, Any]] = []
        self.steps: list[str] = []

    async def entering(self, episode: Episode, step: Step) -> None:
        self.steps.append(step.name)

    async def at_boundary(self, episode: Episode) -> None:
        state = episode.boundary.state()
        if "game" in state:
            self.games.append(state["game"])


async def test_every_boundary_holds_the_game_and_its_rng() -> None:
    built, _ = build_mesh()
    hooks = Recorder()

    def with_hooks(ctx: Any) -> FastAPI:
        app = create_app(ctx.name)
        mount_run(app, nim_app.Nim(ctx).program, ctx.settings, task_model=nim_app.NimTask, hooks=hooks)
        return app

    built.build("nim", with_hooks)
    assert (await run(built, task(stones=21))).status_code == 200
    assert hooks.steps[0] == "start" and hooks.steps[-2:] == ["close_agent", "return"]
    assert set(hooks.steps[1:-2]) == {"act"} and len(hooks.steps) > 5
    piles = [game["pile"] for game in hooks.games]
    assert piles == sorted(piles, reverse=True) and piles[0] == 21
    assert len({game["rng_state"] for game in hooks.games}) > 1  # the opponent's dice moved on
    await built.aclose()


async def test_activations_are_numbered_from_one_and_the_session_closed() -> None:
    built, _ = build_mesh()
    seen: list[tuple[str | None, str | None]] = []
    closed: list[str] = []
    agent = create_app("simple_agent")

    @agent.post("/v1/responses")
    async def responses(request: Request) -> dict[str, Any]:
        identity = current_identity()
        key = identity.capture_key if identity else None
        seen.append((key, request.headers.get("x-ng-agent-activation")))
        return {"output": [message("1")], "usage": None}

    @agent.post("/close")
    async def close() -> dict[str, bool]:
        identity = current_identity()
        closed.append(identity.capture_key if identity else "")
        return {"closed": True}

    built.serve("simple_agent", agent)
    built.build("nim", nim_app.create_app)
    result = (await run(built, task(stones=6, opponent_skill=0.0))).json()
    assert [activation for _, activation in seen] == [str(n) for n in range(1, result["activations"] + 1)]
    assert {key for key, _ in seen} == {"5-2"} and closed == ["5-2"]
    await built.aclose()


@pytest.mark.parametrize("number", ["123456789012345678901", "9" * 5000])
async def test_a_move_too_long_to_be_one_is_an_invalid_action(number: str) -> None:
    """21 digits made the state unwritable (500), 5,000 raised from int() (500): both name no move."""
    built, model = build_mesh()
    built.build("nim", nim_app.create_app)
    model.policy = lambda body: [message(f"I take {number}.")]
    reply = await run(built, task(max_invalid=2))
    assert reply.status_code == 200, reply.text
    assert reply.json()["invalid_actions"] == 2 and reply.json()["winner"] == "opponent"
    await built.aclose()
