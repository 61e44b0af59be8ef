"""Bad input is a structured 4xx on every route; the worker's failures come back as our errors."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import orjson
import pytest

from model_servers.policy_model.app import create_app
from model_servers.policy_model.tests.conftest import WORKER_REF, PolicyClient, policy_ctx
from model_servers.policy_model.tests.scripted_worker import Generate, ScriptedWorker, WorkerFails
from nemo_gym_ckpt.client import MeshClient

pytestmark = pytest.mark.unit

USER = {"role": "user", "content": "hi"}
TOKENS = {"prompt_token_ids": [1], "generation_token_ids": [2]}
GARBAGE: list[bytes] = [
    b"",
    b"not json",
    b"[]",
    b'"text"',
    b"null",
    b"{}",
    b'{"messages": "x", "input": 5}',
    b'{"messages": [{"role": "robot"}], "input": [{"type": "reasoning"}]}',
]


def assert_structured(reply: httpx.Response, status: int, code: str | None = None) -> dict[str, Any]:
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert set(error) == {"code", "detail"} and error["detail"]
    if code is not None:
        assert error["code"] == code
    return error


async def test_garbage_on_every_route_is_a_structured_4xx(
    policy_client: PolicyClient, worker: ScriptedWorker, tokenizer_dir: Any
) -> None:
    app = create_app(
        policy_ctx(
            MeshClient(transport=httpx.ASGITransport(app=worker.app)),
            worker=WORKER_REF,
            tokenizer_path=str(tokenizer_dir),
        )
    )
    paths = app.openapi()["paths"]  # every route of the app, included routers too
    routes = [(path, method.upper()) for path, methods in paths.items() for method in methods]
    assert {path for path, _ in routes} >= {"/v1/models", "/v1/chat/completions", "/v1/responses"}
    async with policy_client() as http:
        for path, method in routes:
            for prefix in ("", "/ng-rollout/r1-a2"):
                for garbage in GARBAGE:
                    reply = await http.request(
                        method if method == "POST" else "POST",
                        prefix + path,
                        content=garbage,
                        headers={"content-type": "application/json"},
                    )
                    assert_structured(reply, 400 if method == "POST" else 405)
    assert worker.requests == []


@pytest.mark.parametrize(
    ("path", "payload", "words"),
    [
        ("/v1/chat/completions", {"messages": [USER], "n": 2}, "n=2"),
        ("/v1/chat/completions", {"messages": [USER], "tool_choice": "required"}, "tool_choice"),
        (
            "/v1/chat/completions",
            {"messages": [USER], "tool_choice": {"type": "function", "function": {"name": "add"}}},
            "tool_choice",
        ),
        ("/v1/chat/completions", {"messages": [USER], "frequency_penalty": 1}, "frequency_penalty"),
        ("/v1/chat/completions", {"messages": [USER], "temperature": 9}, "temperature"),
        ("/v1/chat/completions", {"messages": [USER], "stop": [""]}, "stop"),
        ("/v1/chat/completions", {"messages": []}, "messages"),
        ("/v1/chat/completions", {"messages": [{**USER, "prompt_token_ids": [1]}]}, "together"),
        (
            "/v1/chat/completions",
            {
                "messages": [
                    {
                        "role": "assistant",
                        "content": "x",
                        "prompt_token_ids": [1],
                        "generation_token_ids": [1, 99999],
                    },
                    USER,
                ]
            },
            "vocabulary",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "content",
        ),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 300}]}, "context"),
        ("/v1/chat/completions", {"messages": [USER], "tools": [{"type": "web_search"}]}, "tools"),
        ("/v1/responses", {"input": "hi", "stream": True}, "stream"),
        (
            "/v1/responses",
            {"input": [{"role": "user", "content": "x", **TOKENS}]},
            "assistant",
        ),
        ("/v1/responses", {"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
        ("/v1/responses", {"input": [{"type": "reasoning", "summary": []}]}, "input"),
        ("/v1/responses", {"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input"),
        ("/v1/responses", {"input": []}, "no message"),
        ("/v1/responses", {"input": "hi", "tool_choice": "required"}, "tool_choice"),
    ],
)
async def test_refusals(
    policy_client: PolicyClient, worker: ScriptedWorker, path: str, payload: dict[str, Any], words: str
) -> None:
    async with policy_client() as http:
        error = assert_structured(await http.post(path, json=payload), 400, "invalid_request")
    assert words in error["detail"]
    assert worker.requests == []


@pytest.mark.parametrize(
    ("failure", "status", "code"),
    [
        (
            WorkerFails(400, {"error": {"code": "invalid_request", "detail": "prompt too long"}}),
            400,
            "invalid_request",
        ),
        (
            WorkerFails(503, {"error": {"code": "unavailable", "detail": "engine not loaded"}}),
            503,
            "unavailable",
        ),
        (WorkerFails(500, {"detail": "boom"}), 502, "upstream_error"),
        (WorkerFails(200, {"choices": []}), 502, "upstream_error"),
        (
            WorkerFails(
                200,
                {
                    "choices": [
                        {
                            "token_ids": [],
                            "logprobs": {"token_logprobs": []},
                            "finish_reason": "stop",
                            "prompt_token_ids": [1],
                        }
                    ]
                },
            ),
            502,
            "upstream_error",
        ),
        (
            WorkerFails(
                200,
                {
                    "choices": [
                        {"token_ids": [1, 2], "logprobs": {"token_logprobs": [0.0]}, "finish_reason": "stop"}
                    ]
                },
            ),
            502,
            "upstream_error",
        ),
        (
            WorkerFails(200, {"choices": [{"token_ids": [], "logprobs": {"token_logprobs": []}}]}),
            502,
            "upstream_error",
        ),
    ],
)
async def test_worker_failures_map_to_our_errors(
    policy_client: PolicyClient, worker: ScriptedWorker, failure: WorkerFails, status: int, code: str
) -> None:
    worker.will(failure, failure)
    async with policy_client() as http:
        assert_structured(await http.post("/v1/chat/completions", json={"messages": [USER]}), status, code)
        assert_structured(await http.post("/v1/responses", json={"input": "hi"}), status, code)


async def test_worker_error_before_a_stream_is_a_plain_error(
    policy_client: PolicyClient, worker: ScriptedWorker
) -> None:
    worker.will(WorkerFails(400, {"error": {"code": "invalid_request", "detail": "bad prompt"}}))
    async with policy_client() as http:
        reply = await http.post("/v1/chat/completions", json={"messages": [USER], "stream": True})
    assert "bad prompt" in assert_structured(reply, 400, "invalid_request")["detail"]


async def test_worker_failure_mid_stream_is_an_error_event(
    policy_client: PolicyClient, worker: ScriptedWorker
) -> None:
    worker.will(Generate("Hello there", error_after=4))
    async with policy_client() as http:
        reply = await http.post("/v1/chat/completions", json={"messages": [USER], "stream": True})
    assert reply.status_code == 200
    events = [orjson.loads(line.removeprefix("data: ")) for line in reply.text.split("\n\n") if line]
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1]) == "Hell"
    assert events[-1]["error"]["code"] == "unavailable"
    assert events[-1]["error"]["message"] == "engine stopped"
    assert "[DONE]" not in reply.text


@pytest.mark.parametrize(("option", "bound", "what"), [("max_reply_bytes", 4096, "the 200 reply"),
                                                       ("max_stream_line_bytes", 256, "a line of the 200 reply")])
async def test_a_worker_stream_past_the_client_s_bounds_is_an_error_event(
    policy_client: PolicyClient, worker: ScriptedWorker, option: str, bound: int, what: str
) -> None:
    """The policy model reads the worker's events through its client's bounds: a stream too long in
    all (200 events of about 250 bytes) or one event too long (the first, echoing the prompt, is about
    280 bytes) ends the chat stream with ``upstream_error``, never an unbounded read."""
    worker.will("x" * 200)
    async with policy_client(client_options={option: bound}) as http:
        reply = await http.post("/v1/chat/completions", json={"messages": [USER], "stream": True})
    assert reply.status_code == 200
    assert "[DONE]" not in reply.text
    last = orjson.loads(reply.text.split("\n\n")[-2].removeprefix("data: "))
    assert last["error"]["code"] == "upstream_error"
    assert f"{what} is longer than the client's bound of {bound} bytes" in last["error"]["message"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@asynccontextmanager
async def policy_towards(port: int, tokenizer_dir: Any, **settings: Any) -> AsyncIterator[httpx.AsyncClient]:
    """The policy app in process, its worker at ``127.0.0.1:port`` reached over real sockets."""
    async with MeshClient(transport="httpx", retries=0) as client:
        ctx = policy_ctx(
            client, worker_port=port, worker=WORKER_REF, tokenizer_path=str(tokenizer_dir), **settings
        )
        app = create_app(ctx)
        transport = httpx.ASGITransport(app=app)
        async with (
            app.router.lifespan_context(app),
            httpx.AsyncClient(transport=transport, base_url="http://p") as http,
        ):
            yield http


async def test_unreachable_worker_is_unavailable(tokenizer_dir: Any) -> None:
    async with policy_towards(free_port(), tokenizer_dir) as http:
        reply = await http.post("/v1/chat/completions", json={"messages": [USER]})
    assert_structured(reply, 503, "unavailable")


async def test_worker_timeout_is_upstream_timeout(tokenizer_dir: Any) -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()  # accepts connections but never answers
        async with policy_towards(listener.getsockname()[1], tokenizer_dir, request_timeout_s=0.3) as http:
            reply = await http.post("/v1/chat/completions", json={"messages": [USER]})
    assert_structured(reply, 504, "upstream_timeout")
