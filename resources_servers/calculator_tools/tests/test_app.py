"""calculator_tools over httpx.ASGITransport: the three tools, verify, declarations, bad input."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from nemo_gym_ckpt.config import load_config_dict
from nemo_gym_ckpt.context import ServerContext
from resources_servers.calculator_tools.app import OPERAND_LIMIT, create_app

pytestmark = pytest.mark.unit


def answer(text: str) -> dict[str, Any]:
    message = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": text}]}
    return {"output": [message]}


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    mesh = load_config_dict({"calc": {"resources_servers": {"calculator_tools": {}}}})
    ctx: ServerContext[Any] = ServerContext("calc", mesh.instance("calc").settings, mesh)
    transport = httpx.ASGITransport(app=create_app(ctx))
    async with httpx.AsyncClient(transport=transport, base_url="http://calc") as http:
        yield http
    await ctx.aclose()


@pytest.mark.parametrize(
    ("name", "args", "text"),
    [
        ("add", {"a": 412, "b": 389}, "801"),
        ("subtract", {"a": 58, "b": 731}, "-673"),
        ("multiply", {"a": 97, "b": 53}, "5141"),
        ("multiply", {"a": OPERAND_LIMIT, "b": OPERAND_LIMIT}, str(OPERAND_LIMIT**2)),
    ],
)
async def test_tools_answer_bare_number_text(client: httpx.AsyncClient, name: str, args: dict[str, int],
                                             text: str) -> None:
    reply = await client.post(f"/{name}", json=args)
    assert (reply.status_code, reply.text) == (200, text)
    assert reply.headers["content-type"] == "application/json"


async def test_tools_work_under_the_rollout_prefix_without_a_session(client: httpx.AsyncClient) -> None:
    reply = await client.post("/ng-rollout/r1-a2/add", json={"a": 1, "b": 2})
    assert (reply.status_code, reply.text) == (200, "3")


@pytest.mark.parametrize(
    ("body", "detail"),
    [
        (b"{not json", "not valid JSON"),
        (b'"a=1"', "valid dictionary"),
        (b'{"a": 1}', "b: Field required"),
        (b'{"a": "1", "b": 2}', "a: Input should be a valid integer"),
        (b'{"a": true, "b": 2}', "a: Input should be a valid integer"),
        (b'{"a": 1.5, "b": 2}', "a: Input should be a valid integer"),
        (b'{"a": null, "b": 2}', "a: Input should be a valid integer"),
        (b'{"a": 1, "b": 2, "c": 3}', "c: Extra inputs are not permitted"),
        (b'{"a": 10000000000000001, "b": 2}', "a: Input should be less than or equal"),
        (b"", "a: Field required"),
    ],
)
async def test_bad_tool_arguments_are_400(client: httpx.AsyncClient, body: bytes, detail: str) -> None:
    reply = await client.post("/multiply", content=body, headers={"content-type": "application/json"})
    assert reply.status_code == 400
    assert reply.json()["error"]["code"] == "invalid_request"
    assert detail in reply.json()["error"]["detail"]


async def test_unknown_tool_and_wrong_method(client: httpx.AsyncClient) -> None:
    reply = await client.post("/divide", json={"a": 4, "b": 2})
    assert (reply.status_code, reply.json()["error"]["code"]) == (404, "not_found")
    reply = await client.get("/add")
    assert (reply.status_code, reply.json()["error"]["code"]) == (405, "method_not_allowed")


async def test_tool_definitions(client: httpx.AsyncClient) -> None:
    tools = (await client.get("/tools")).json()
    assert [t["name"] for t in tools] == ["add", "subtract", "multiply"]
    assert tools[2]["description"] == "Return a * b."
    assert tools[0]["type"] == "function" and tools[0]["strict"] is True
    params = tools[0]["parameters"]
    assert (params["type"], params["required"]) == ("object", ["a", "b"])
    assert params["additionalProperties"] is False
    assert params["properties"]["a"]["type"] == "integer" and "title" not in params
    chat = (await client.get("/tools", params={"shape": "chat"})).json()
    assert chat[1] == {"type": "function", "function": {k: v for k, v in tools[1].items() if k != "type"}}
    reply = await client.get("/tools", params={"shape": "xml"})
    assert reply.status_code == 400


@pytest.mark.parametrize(
    ("text", "expected", "reward", "extracted"),
    [
        ("The answer is 5141.", 5141, 1.0, 5141),
        ("The answer is 5141.", "5141", 1.0, 5141),
        ("the answer is 5,141.", 5141, 1.0, 5141),
        ("The answer is -673.", -673, 1.0, -673),
        ("The answer is 2.50.", 2.5, 1.0, 2.5),
        ("The answer is 12. No wait, the answer is 13.", 13, 1.0, 13),
        ("The answer is 5142.", 5141, 0.0, 5142),
        ("5141", 5141, 0.0, None),
        ("", 5141, 0.0, None),
        ("The answer is 9223372036854775807.", 9223372036854775807, 1.0, 9223372036854775807),  # 64 bits
        ("The answer is 9223372036854775808.", 9223372036854775807, 0.0, "9223372036854775808"),
        ("The answer is 1" + "0" * 95 + ".", 5, 0.0, "1" + "0" * 95),
        ("The answer is 1" + "0" * 95 + ".", "1" + "0" * 95, 1.0, "1" + "0" * 95),  # exact, not a float
        ("The answer is 1" + "0" * 95 + "1.", "1" + "0" * 96, 0.0, "1" + "0" * 95 + "1"),
        ("The answer is -1" + "0" * 5000 + ".0.", 5, 0.0, "-1" + "0" * 5000),
        ("The answer is 1.5" + "0" * 400 + "1.", 1.5, 0.0, 1.5),
        ("The answer is 1" + "0" * 400 + ".5.", 5, 0.0, "1" + "0" * 400 + ".5"),  # past a float's range
    ],
)
async def test_verify(client: httpx.AsyncClient, text: str, expected: Any, reward: float,
                      extracted: Any) -> None:
    row = {"responses_create_params": {"input": "q"}, "expected_answer": expected, "response": answer(text)}
    reply = await client.post("/verify", json=row)
    assert reply.status_code == 200, reply.text
    assert reply.json() == {**row, "reward": reward, "extracted_answer": extracted}


async def test_verify_without_a_message_is_reward_zero(client: httpx.AsyncClient) -> None:
    call = {"type": "function_call", "name": "add", "arguments": "{}", "call_id": "c"}
    reply = await client.post("/verify", json={"expected_answer": 3, "response": {"output": [call]}})
    assert (reply.json()["reward"], reply.json()["extracted_answer"]) == (0.0, None)


@pytest.mark.parametrize(
    "row",
    [
        {"expected_answer": "five", "response": {"output": []}},
        {"expected_answer": "NaN", "response": {"output": []}},
        {"expected_answer": None, "response": {"output": []}},
        {"response": {"output": []}},
        {"expected_answer": 5},
        {"expected_answer": 5, "response": {"output": [1, 2]}},
    ],
)
async def test_bad_verify_bodies_are_400(client: httpx.AsyncClient, row: dict[str, Any]) -> None:
    reply = await client.post("/verify", json=row)
    assert (reply.status_code, reply.json()["error"]["code"]) == (400, "invalid_request")


async def test_seed_session_declares_replay(client: httpx.AsyncClient) -> None:
    reply = await client.post("/seed_session", json={"responses_create_params": {"input": "q"}})
    assert reply.status_code == 200
    assert reply.headers["x-ng-checkpoint-verify"] == "replay"
    assert "x-ng-checkpoint-restart" not in reply.headers
    assert reply.json() == {"resources_session_id": reply.cookies["ng_session_calc"], "resources_tools": None,
                            "sandbox_access": None}  # NeMo Gym's seed reply
    reply = await client.post("/seed_session", json={"responses_create_params": "q"})
    assert (reply.status_code, reply.json()["error"]["code"]) == (400, "invalid_request")
