"""string_match over httpx.ASGITransport: verify modes, seed headers, bad input."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest

from nemo_gym_ckpt.config import load_config_dict
from nemo_gym_ckpt.context import ServerContext
from nemo_gym_ckpt.errors import ConfigError
from resources_servers.string_match.app import create_app

pytestmark = pytest.mark.unit



def answer(text: str) -> dict[str, Any]:
    message = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": text}]}
    return {"output": [message]}


@pytest.fixture
async def make_client() -> AsyncIterator[Callable[..., httpx.AsyncClient]]:
    contexts: list[ServerContext[Any]] = []

    def make(**settings: Any) -> httpx.AsyncClient:
        mesh = load_config_dict({"sm": {"resources_servers": {"string_match": settings}}})
        ctx: ServerContext[Any] = ServerContext("sm", mesh.instance("sm").settings, mesh)
        contexts.append(ctx)
        return httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(ctx)), base_url="http://sm")

    yield make
    for ctx in contexts:
        await ctx.aclose()


@pytest.fixture
async def client(make_client: Callable[..., httpx.AsyncClient]) -> AsyncIterator[httpx.AsyncClient]:
    async with make_client() as http:
        yield http


async def reward(http: httpx.AsyncClient, text: str, expected: Any) -> float:
    reply = await http.post("/verify", json={"expected_answer": expected, "response": answer(text)})
    assert reply.status_code == 200, reply.text
    return float(reply.json()["reward"])


async def test_exact_match_normalises_whitespace(client: httpx.AsyncClient) -> None:
    assert await reward(client, "  hello \n\t world ", "hello world") == 1.0
    assert await reward(client, "hello world!", "hello world") == 0.0
    assert await reward(client, "Hello world", "hello world") == 0.0


async def test_verify_echoes_the_row_and_adds_fields(client: httpx.AsyncClient) -> None:
    row = {"responses_create_params": {"input": "q"}, "expected_answer": "Paris", "task_id": 7,
           "response": answer("Paris")}
    body = (await client.post("/verify", json=row)).json()
    assert body == {**row, "reward": 1.0, "extracted_answer": "Paris"}


async def test_any_of_a_list_of_answers(client: httpx.AsyncClient) -> None:
    assert await reward(client, "colour", ["color", "colour"]) == 1.0
    assert await reward(client, "hue", ["color", "colour"]) == 0.0


async def test_case_insensitive_and_substring(make_client: Callable[..., httpx.AsyncClient]) -> None:
    async with make_client(case_sensitive=False) as http:
        assert await reward(http, "PARIS", "paris") == 1.0
        assert await reward(http, "It is Paris", "paris") == 0.0
    async with make_client(mode="substring", case_sensitive=False) as http:
        assert await reward(http, "It is  PARIS.", "paris") == 1.0
        assert await reward(http, "It is Rome.", "paris") == 0.0
    async with make_client(mode="substring") as http:
        assert await reward(http, "It is PARIS.", "Paris") == 0.0


async def test_last_message_is_the_answer(client: httpx.AsyncClient) -> None:
    output = [
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Paris"}]},
        {"type": "function_call", "name": "x", "arguments": "{}", "call_id": "c1"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Rome"}]},
    ]
    row = {"expected_answer": "Rome", "response": {"output": output}}
    body = (await client.post("/verify", json=row)).json()
    assert (body["reward"], body["extracted_answer"]) == (1.0, "Rome")


async def test_no_message_is_reward_zero(client: httpx.AsyncClient) -> None:
    reply = await client.post("/verify", json={"expected_answer": "x", "response": {"output": []}})
    assert (reply.status_code, reply.json()["reward"], reply.json()["extracted_answer"]) == (200, 0.0, None)


@pytest.mark.parametrize(
    ("body", "detail"),
    [
        (b"not json", "not valid JSON"),
        (b"[1, 2]", "is a JSON object"),
        (b'{"response": {"output": []}}', "expected_answer"),
        (b'{"expected_answer": "x"}', "response"),
        (b'{"expected_answer": "x", "response": {"output": "text"}}', "response.output"),
        (b'{"expected_answer": 5, "response": {"output": []}}', "expected_answer"),
        (b'{"expected_answer": [], "response": {"output": []}}', "expected_answer"),
    ],
)
async def test_bad_verify_bodies_are_400(client: httpx.AsyncClient, body: bytes, detail: str) -> None:
    reply = await client.post("/verify", content=body, headers={"content-type": "application/json"})
    assert reply.status_code == 400
    assert reply.json()["error"]["code"] == "invalid_request"
    assert detail in reply.json()["error"]["detail"]


async def test_seed_session_declares_replay_and_no_restart(client: httpx.AsyncClient) -> None:
    reply = await client.post("/seed_session", json={"responses_create_params": {"input": "q"}, "extra": 1})
    assert reply.status_code == 200
    assert reply.headers["x-ng-checkpoint-verify"] == "replay"
    assert "x-ng-checkpoint-restart" not in reply.headers
    assert reply.cookies["ng_session_sm"] == reply.json()["resources_session_id"]


async def test_no_tools_and_unknown_tool_is_404(client: httpx.AsyncClient) -> None:
    assert (await client.get("/tools")).json() == []
    reply = await client.post("/add", json={"a": 1, "b": 2})
    assert (reply.status_code, reply.json()["error"]["code"]) == (404, "not_found")


def test_config_typos_and_checkpoint_overrides_are_errors() -> None:
    with pytest.raises(ConfigError, match="mode"):
        load_config_dict({"sm": {"resources_servers": {"string_match": {"mode": "fuzzy"}}}})
    with pytest.raises(ConfigError, match="checkpoint_mode"):
        load_config_dict({"sm": {"resources_servers": {"string_match": {"checkpoint_mode": "exported"}}}})
