"""The simple agent in process: a scripted policy model, the real calculator_tools, a stateful tally."""

from __future__ import annotations

import json
import random
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from agents.simple_agent import app as agent_app
from agents.simple_agent.loop import LoopState, tool_request
from model_servers.inference_worker.default_model_data import make_problem
from nemo_gym_ckpt.config import ServerConfig, ServerRef
from nemo_gym_ckpt.identity import RolloutIdentity
from nemo_gym_ckpt.testing.scripted_model import ScriptedModel, calculator_policy, function_call, message
from nemo_gym_ckpt.testing.tally import Tally
from nemo_gym_ckpt.testing.transports import InProcessMesh
from resources_servers.calculator_tools import app as calculator_app

pytestmark = pytest.mark.unit

PROBLEM = make_problem(random.Random(3))
TOOLS = [spec.definition() for spec in calculator_app.CalculatorTools.tool_specs.values()]
BODY = {"input": [{"role": "user", "content": PROBLEM["question"]}], "tools": TOOLS, "temperature": 0.0}
RID = RolloutIdentity("4-1")


def build_mesh(
    policy: Any, resources: str = "calculator_tools", **agent: Any
) -> tuple[InProcessMesh, ScriptedModel]:
    model = ScriptedModel(policy)
    resources_ref = ServerRef(type="resources_servers", name=resources) if resources else None
    mesh = InProcessMesh({
        "policy_model": ("responses_api_models", "scripted", ServerConfig()),
        "calculator_tools": ("resources_servers", "calculator_tools", calculator_app.Config()),
        "tally": ("resources_servers", "tally", ServerConfig()),
        "simple_agent": ("responses_api_agents", "simple_agent", agent_app.Config(
            model_server=ServerRef(type="responses_api_models", name="policy_model"),
            resources_server=resources_ref, **agent)),
    })
    mesh.serve("policy_model", model.app())
    mesh.build("calculator_tools", calculator_app.create_app)
    mesh.build("simple_agent", agent_app.create_app)
    return mesh, model


@pytest.fixture
async def calculator() -> AsyncIterator[tuple[InProcessMesh, ScriptedModel]]:
    mesh, model = build_mesh(calculator_policy({PROBLEM["question"]: PROBLEM}))
    yield mesh, model
    await mesh.aclose()


async def ask(mesh: InProcessMesh, body: Any, *, identity: RolloutIdentity | None = RID,
              headers: dict[str, str] | None = None, cookies: dict[str, str] | None = None) -> httpx.Response:
    client = mesh.client()
    return await client.request("POST", mesh.url_of("simple_agent") + "/v1/responses", json=body,
                                identity=identity, headers=headers, cookies=cookies, check=False)


async def test_the_loop_calls_the_tool_then_answers(calculator: tuple[InProcessMesh, ScriptedModel]) -> None:
    mesh, model = calculator
    reply = await ask(mesh, BODY, headers={"x-ng-agent-activation": "1"})
    assert reply.status_code == 200, reply.text
    response = reply.json()
    kinds = [item["type"] for item in response["output"]]
    assert kinds == ["function_call", "function_call_output", "message"]
    assert response["output"][1]["output"] == str(PROBLEM["answer"])
    assert response["output"][1]["call_id"] == response["output"][0]["call_id"]
    assert response["output"][2]["content"][0]["text"] == f"The answer is {PROBLEM['answer']}."
    assert response["usage"]["input_tokens"] == 20
    assert response["usage"]["input_tokens_details"]["cached_tokens"] == 0
    assert response["id"] == "resp_2"
    first, second = (call.body for call in model.calls)
    assert first["input"] == BODY["input"] and first["tools"] == TOOLS and first["temperature"] == 0.0
    assert second["input"] == BODY["input"] + response["output"][:2]  # earlier outputs passed back verbatim
    assert "return_token_ids" not in first
    assert {call.capture_key for call in model.calls} == {"4-1"}


async def test_a_string_input_is_one_user_message(calculator: tuple[InProcessMesh, ScriptedModel]) -> None:
    mesh, model = calculator
    reply = await ask(mesh, {**BODY, "input": PROBLEM["question"]})
    assert reply.status_code == 200, reply.text
    expected = [{"type": "message", "role": "user", "content": PROBLEM["question"]}]
    assert model.calls[0].body["input"] == expected


async def test_token_ids_are_requested_and_passed_back_verbatim() -> None:
    mesh, model = build_mesh(calculator_policy({PROBLEM["question"]: PROBLEM}), return_token_ids=True)
    reply = await ask(mesh, BODY)
    output = reply.json()["output"]
    assert all(call.body["return_token_ids"] is True for call in model.calls)
    assert output[0]["generation_token_ids"] == [1, 7] and output[2]["generation_token_ids"] == [2, 7]
    assert model.calls[1].body["input"][-2] == output[0]
    await mesh.aclose()


@pytest.mark.parametrize(
    ("call", "expected"),
    [
        (function_call("add", "{not json"), "are not valid JSON"),
        (function_call("add", "[1, 2]"), "must be a JSON object"),
        (function_call("../verify", {"a": 1}), "unknown tool"),
        (function_call("divide", {"a": 1, "b": 2}), "not_found"),
        (function_call("add", {"a": "x", "b": 2}), "invalid_request"),
        (function_call("add", '{"a":' * 300 + "1" + "}" * 300), "cannot be sent as JSON"),  # json reads it
        (function_call("add", '{"a":' * 100_000 + "1" + "}" * 100_000), "nested too deeply"),  # RecursionError
        (function_call("add", '{"a": 18446744073709551616, "b": 1}'), "cannot be sent as JSON"),  # 65 bits
    ],
)
async def test_bad_tool_calls_become_text_the_model_sees(call: dict[str, Any], expected: str) -> None:
    def policy(body: dict[str, Any]) -> list[dict[str, Any]]:
        last = body["input"][-1]
        return [message("giving up")] if last.get("type") == "function_call_output" else [call]

    mesh, model = build_mesh(policy)
    reply = await ask(mesh, BODY)
    assert reply.status_code == 200, reply.text
    output = reply.json()["output"]
    assert [item["type"] for item in output] == ["function_call", "function_call_output", "message"]
    assert expected in output[1]["output"]
    assert model.calls[1].body["input"][-1] == output[1]
    await mesh.aclose()


async def test_max_steps_bounds_the_model_calls() -> None:
    mesh, model = build_mesh(lambda body: [function_call("add", {"a": 1, "b": 1})], max_steps=3)
    reply = await ask(mesh, BODY)
    output = reply.json()["output"]
    assert len(model.calls) == 3 and len(output) == 6 and output[-1]["type"] == "function_call_output"
    await mesh.aclose()


async def test_an_incomplete_response_stops_the_loop() -> None:
    mesh, model = build_mesh(lambda body: [function_call("add", {"a": 1, "b": 1})])
    model.incomplete = True
    reply = await ask(mesh, BODY)
    response = reply.json()
    assert len(model.calls) == 1 and [item["type"] for item in response["output"]] == ["function_call"]
    assert response["incomplete_details"] == {"reason": "max_output_tokens"}
    await mesh.aclose()


async def test_resources_cookies_are_passed_to_tools_and_returned() -> None:
    def policy(body: dict[str, Any]) -> list[dict[str, Any]]:
        calls = sum(1 for item in body["input"] if item.get("type") == "function_call_output")
        return [function_call("bump", {"by": 2})] if calls < 2 else [message("done")]

    mesh, _ = build_mesh(policy, resources="tally")
    tally = Tally(mesh.context("tally"))
    mesh.serve("tally", tally.build_app())
    client = mesh.client()
    seeded = await client.request("POST", mesh.url_of("tally") + "/seed_session", json=BODY, identity=RID)
    cookies = dict(seeded.cookies.items())
    reply = await ask(mesh, BODY, cookies=cookies)
    outputs = [item["output"] for item in reply.json()["output"] if item["type"] == "function_call_output"]
    assert outputs == ["2", "4"]
    assert dict(reply.cookies.items()) == cookies
    [session] = list(tally.sessions)
    assert session.state == {"tally": 4}
    # without the session cookie the tool refuses, and the model reads the refusal
    reply = await ask(mesh, BODY)
    outputs = [item["output"] for item in reply.json()["output"] if item["type"] == "function_call_output"]
    assert all("no session" in text for text in outputs)
    await mesh.aclose()


async def test_an_agent_without_resources_tells_the_model() -> None:
    mesh, _ = build_mesh(calculator_policy({PROBLEM["question"]: PROBLEM}), resources="")
    output = (await ask(mesh, BODY)).json()["output"]
    assert "no_tools" in output[1]["output"]
    await mesh.aclose()


async def test_sessions_record_activations_and_close(calculator: tuple[InProcessMesh, ScriptedModel]) -> None:
    mesh, _ = calculator
    client = mesh.client()
    for activation in ("1", "2"):
        assert (await ask(mesh, BODY, headers={"x-ng-agent-activation": activation})).status_code == 200
    close = mesh.url_of("simple_agent") + "/close"
    assert (await client.post_json(close, {}, identity=RID)) == {"closed": True}
    assert (await client.post_json(close, {}, identity=RID)) == {"closed": False}


async def test_sessions_keep_activations_by_capture_key() -> None:
    mesh, _ = build_mesh(calculator_policy({PROBLEM["question"]: PROBLEM}))
    agent = agent_app.SimpleAgent(mesh.context("simple_agent"))
    app = mesh.build("simple_agent", lambda ctx: _app_of(agent))
    assert app is not None
    await ask(mesh, BODY, headers={"x-ng-agent-activation": "1"})
    await ask(mesh, BODY, headers={"x-ng-agent-activation": "2"})
    await ask(mesh, BODY, identity=None)
    session = agent.sessions["4-1"]
    assert session.activations == [1, 2] and session.loop is not None and session.loop.stop_reason == "answer"
    assert list(agent.sessions) == ["4-1"]
    await mesh.aclose()


def _app_of(agent: agent_app.SimpleAgent) -> Any:
    from nemo_gym_ckpt.server import create_app

    app = create_app("simple_agent")
    app.add_api_route("/v1/responses", agent.responses, methods=["POST"])
    app.add_api_route("/close", agent.close, methods=["POST"])
    return app


@pytest.mark.parametrize(
    ("body", "headers", "detail"),
    [
        ({"tools": TOOLS}, {}, "input"),
        ({**BODY, "stream": True}, {}, "does not stream"),
        (BODY, {"x-ng-agent-activation": "0"}, "x-ng-agent-activation"),
        (BODY, {"x-ng-agent-activation": "one"}, "x-ng-agent-activation"),
        ([1, 2], {}, "body"),
    ],
)
async def test_bad_requests_are_structured_400s(
    calculator: tuple[InProcessMesh, ScriptedModel], body: Any, headers: dict[str, str], detail: str
) -> None:
    mesh, model = calculator
    reply = await ask(mesh, body, headers=headers)
    assert reply.status_code == 400
    assert reply.json()["error"]["code"] == "invalid_request" and detail in reply.json()["error"]["detail"]
    assert model.calls == []


async def test_a_dead_or_broken_model_is_a_structured_error(
    calculator: tuple[InProcessMesh, ScriptedModel],
) -> None:
    mesh, model = calculator
    model.policy = lambda body: "not a list"  # type: ignore[assignment,return-value]
    reply = await ask(mesh, BODY)
    assert reply.status_code == 502 and reply.json()["error"]["code"] == "upstream_error"
    mesh.transport.unmount(mesh.url_of("policy_model"))
    reply = await ask(mesh, BODY)
    assert reply.status_code == 503 and reply.json()["error"]["code"] == "unavailable"


def test_loop_state_is_json_and_tool_requests_parse() -> None:
    state = LoopState([{"role": "user", "content": "hi"}], {"tools": []}, 4, cookies={"c": "1"})
    assert LoopState.from_json(json.loads(json.dumps(state.to_json()))) == state
    assert tool_request(function_call("add", {"a": 1, "b": 2})) == ("add", {"a": 1, "b": 2})
    assert tool_request({"name": "add", "arguments": ""}) == ("add", {})
