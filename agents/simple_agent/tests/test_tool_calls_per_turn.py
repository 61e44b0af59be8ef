"""``max_tool_calls_per_turn``: of one model reply's function calls, the first N run; each later one is
answered, in order, with a ``too_many_tool_calls`` error text and runs nothing, so every call has its
output. ``max_steps`` bounds the model calls, this their tool calls."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from agents.simple_agent import app as agent_app
from agents.simple_agent.loop import MAX_TOOL_CALLS_PER_TURN, LoopState, ModelReply, advance, check_loop_state
from agents.simple_agent.tests.test_app import BODY, RID, ask, build_mesh
from nemo_gym_ckpt.config import ServerRef
from nemo_gym_ckpt.testing.scripted_model import function_call, message
from nemo_gym_ckpt.testing.tally import Tally

pytestmark = pytest.mark.unit


def calls_then_answer(count: int) -> Any:
    """A policy that answers ``count`` bumps at once, then (after any tool output) a message."""

    def policy(body: dict[str, Any]) -> list[dict[str, Any]]:
        if body["input"][-1].get("type") == "function_call_output":
            return [message("done")]
        return [function_call("bump", {"by": 1}, call_id=f"c{i}") for i in range(count)]

    return policy


async def tally_run(count: int, **agent: Any) -> tuple[list[dict[str, Any]], int, list[Any]]:
    """One activation whose model answers ``count`` bumps at once: the function call outputs, the
    tally (how many bumps ran) and the model calls."""
    mesh, model = build_mesh(calls_then_answer(count), resources="tally", **agent)
    tally = Tally(mesh.context("tally"))
    mesh.serve("tally", tally.build_app())
    seeded = await mesh.client().request("POST", mesh.url_of("tally") + "/seed_session", json=BODY, identity=RID)
    reply = await ask(mesh, BODY, cookies=dict(seeded.cookies.items()))
    assert reply.status_code == 200, reply.text
    outputs = [item for item in reply.json()["output"] if item["type"] == "function_call_output"]
    [session] = list(tally.sessions)
    await mesh.aclose()
    return outputs, session.state["tally"], model.calls


async def test_the_calls_past_the_bound_are_answered_in_order_and_not_run() -> None:
    outputs, bumps, model_calls = await tally_run(5, max_tool_calls_per_turn=2)
    assert bumps == 2
    assert [item["call_id"] for item in outputs] == ["c0", "c1", "c2", "c3", "c4"]  # every call, in order
    assert [item["output"] for item in outputs[:2]] == ["1", "2"]
    for item in outputs[2:]:
        error = orjson.loads(item["output"])["error"]
        assert error["code"] == "too_many_tool_calls" and "at most 2 tool calls" in error["detail"]
    assert model_calls[1].body["input"][-5:] == outputs  # the model reads every answer


async def test_by_default_one_model_reply_runs_at_most_64_tool_calls() -> None:
    outputs, bumps, model_calls = await tally_run(200, max_steps=1)
    assert (bumps, len(outputs), len(model_calls)) == (64, 200, 1)
    settings = agent_app.Config(model_server=ServerRef(type="responses_api_models", name="policy_model"))
    assert settings.max_tool_calls_per_turn == MAX_TOOL_CALLS_PER_TURN == 64


class CountingCalls:
    """``LoopCalls`` answering three calls at once, then a message; counts the tool calls."""

    def __init__(self) -> None:
        self.tools = 0

    async def call_model(self, body: dict[str, Any], cookies: dict[str, str]) -> ModelReply:
        answered = body["input"][-1].get("type") == "function_call_output"
        output = [message("done")] if answered else [function_call("bump", {}, call_id=f"c{i}") for i in range(3)]
        return ModelReply({"output": output}, {})

    async def call_tool(
        self, name: str, arguments: dict[str, Any], cookies: dict[str, str]
    ) -> tuple[str, dict[str, str]]:
        self.tools += 1
        return str(self.tools), {}


async def test_a_state_holding_answers_past_the_bound_is_checkpointed_and_continued() -> None:
    state, calls = LoopState([{"role": "user", "content": "go"}], {}, 4), CountingCalls()
    await advance(state, calls, max_tool_calls_per_turn=1)  # the model call
    await advance(state, calls, max_tool_calls_per_turn=1)  # c0 runs
    snapshot = orjson.loads(orjson.dumps(state.view()))  # a checkpoint here: c1 and c2 answered already
    check_loop_state(snapshot)
    resumed = LoopState.resumed(snapshot, {"input": state.input, "params": state.params})
    while resumed.stop_reason is None:
        await advance(resumed, calls, max_tool_calls_per_turn=1)
    assert calls.tools == 1 and resumed.stop_reason == "answer"
    answers = [item for item in resumed.outputs if item["type"] == "function_call_output"]
    assert [item["call_id"] for item in answers] == ["c0", "c1", "c2"]
    assert "too_many_tool_calls" in answers[1]["output"] and "too_many_tool_calls" in answers[2]["output"]
