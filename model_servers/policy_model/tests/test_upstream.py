"""Upstream mode: fronting an external OpenAI-compatible server (a fake implementing chat completions)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import httpx
import orjson
import pytest
from fastapi import FastAPI, Request
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.responses import Response
from starlette.responses import JSONResponse

from model_servers.policy_model.app import Config, create_app
from nemo_gym_ckpt.client import MeshClient
from nemo_gym_ckpt.config import load_config_dict
from nemo_gym_ckpt.context import ServerContext
from nemo_gym_ckpt.errors import ConfigError

pytestmark = pytest.mark.unit

UPSTREAM = {"base_url": "http://upstream.example/v1", "api_key": "sk-test", "model": "big-model"}
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]


class FakeUpstream:
    """Implements ``POST /v1/chat/completions`` of the OpenAI API and vLLM's ``POST /tokenize`` with
    scripted replies (one queue per route)."""

    def __init__(self) -> None:
        self.replies: dict[str, list[tuple[int, dict[str, Any]]]] = {"/v1/chat/completions": [], "/tokenize": []}
        self.requests: list[tuple[str, dict[str, str], dict[str, Any]]] = []
        self.app = FastAPI()
        for path in self.replies:
            self.app.post(path)(self._reply)

    def will(self, *replies: dict[str, Any] | tuple[int, dict[str, Any]], path: str = "/v1/chat/completions") -> None:
        self.replies[path].extend(r if isinstance(r, tuple) else (200, r) for r in replies)

    async def _reply(self, request: Request) -> JSONResponse:
        self.requests.append((request.url.path, dict(request.headers), await request.json()))
        status, body = self.replies[request.url.path].pop(0)
        return JSONResponse(body, status_code=status)


def completion(message: dict[str, Any], finish: str = "stop", **extra: Any) -> dict[str, Any]:
    return {
        "id": "chatcmpl-up",
        "object": "chat.completion",
        "created": 1,
        "model": "big-model",
        "choices": [
            {"index": 0, "message": {"role": "assistant", **message}, "finish_reason": finish, **extra}
        ],
        "usage": {"prompt_tokens": 11, "completion_tokens": 3, "total_tokens": 14},
    }


TOOL_CALL_REPLY = completion(
    {
        "content": None,
        "tool_calls": [
            {
                "id": "call_up1",
                "type": "function",
                "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'},
            }
        ],
    },
    "tool_calls",
)


@pytest.fixture
def upstream() -> FakeUpstream:
    return FakeUpstream()


UpstreamClient = Callable[..., AbstractAsyncContextManager[httpx.AsyncClient]]


@pytest.fixture
def upstream_client(upstream: FakeUpstream) -> UpstreamClient:
    @asynccontextmanager
    async def open_client(**settings: Any) -> AsyncIterator[httpx.AsyncClient]:
        mesh = load_config_dict(
            {"policy_model": {"responses_api_models": {"policy_model": {"upstream": UPSTREAM, **settings}}}}
        )
        instance = mesh.instance("policy_model")
        assert isinstance(instance.settings, Config)
        client = MeshClient(transport=httpx.ASGITransport(app=upstream.app))
        app = create_app(ServerContext("policy_model", instance.settings, mesh, client))
        async with client, app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://policy") as http:
                yield http

    return open_client


async def test_chat_is_forwarded(upstream_client: UpstreamClient, upstream: FakeUpstream) -> None:
    upstream.will(TOOL_CALL_REPLY)
    messages = [
        {"role": "user", "content": "1+2?"},
        {"role": "assistant", "content": "x", "prompt_token_ids": [1], "generation_token_ids": [2]},
        {"role": "user", "content": [{"type": "text", "text": "again"}]},
    ]
    async with upstream_client() as http:
        reply = await http.post(
            "/ng-rollout/r1/v1/chat/completions",
            json={"model": "policy", "messages": messages, "tools": TOOLS, "seed": 3},
        )
    assert reply.status_code == 200, reply.text
    body = ChatCompletion.model_validate(reply.json())
    assert body.model == "big-model" and body.choices[0].finish_reason == "tool_calls"
    assert body.choices[0].message.tool_calls[0].id == "call_up1"
    path, headers, sent = upstream.requests[0]
    assert path == "/v1/chat/completions"  # no rollout prefix towards an external server
    assert headers["authorization"] == "Bearer sk-test"
    assert sent["model"] == "big-model" and sent["seed"] == 3 and sent["tools"] == TOOLS
    assert sent["messages"][1] == {"role": "assistant", "content": "x"}  # token fields stripped
    assert sent["messages"][2]["content"] == "again"
    assert "return_token_ids" not in sent
    assert body.usage is not None and body.usage.total_tokens == 14


async def test_responses_are_converted(upstream_client: UpstreamClient, upstream: FakeUpstream) -> None:
    upstream.will(TOOL_CALL_REPLY, completion({"content": "It is 3."}))
    async with upstream_client() as http:
        first = (
            await http.post(
                "/v1/responses",
                json={
                    "input": "1+2?",
                    "tools": [{"type": "function", "name": "add", "parameters": {"type": "object"}}],
                },
            )
        ).json()
        Response.model_validate(first)
        [call] = first["output"]
        assert (call["type"], call["call_id"], call["arguments"]) == (
            "function_call",
            "call_up1",
            '{"a": 1, "b": 2}',
        )
        history = [
            {"role": "user", "content": "1+2?"},
            call,
            {"type": "function_call_output", "call_id": "call_up1", "output": "3"},
        ]
        second = (await http.post("/v1/responses", json={"input": history})).json()
    assert second["output"][0]["content"][0]["text"] == "It is 3."
    sent = upstream.requests[1][2]["messages"]
    assert sent[1]["tool_calls"][0]["id"] == "call_up1"
    assert sent[2] == {"role": "tool", "tool_call_id": "call_up1", "content": "3"}


async def test_token_capture_from_vllm_fields(
    upstream_client: UpstreamClient, upstream: FakeUpstream
) -> None:
    upstream.will(
        completion(
            {"content": "hi"},
            token_ids=[5, 6, 2],
            logprobs={
                "content": [
                    {"token": "h", "logprob": -0.1},
                    {"token": "i", "logprob": -0.2},
                    {"token": "</s>", "logprob": -0.3},
                ]
            },
            prompt_token_ids=[1, 2, 3],
        ),
        completion({"content": "hi"}),
    )
    async with upstream_client(return_token_ids=True) as http:
        body = (
            await http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
        ).json()
        missing = await http.post(
            "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]}
        )
    message = body["choices"][0]["message"]
    assert (message["prompt_token_ids"], message["generation_token_ids"]) == ([1, 2, 3], [5, 6, 2])
    assert message["generation_log_probs"] == [-0.1, -0.2, -0.3]
    assert upstream.requests[0][2]["return_token_ids"] is True and upstream.requests[0][2]["logprobs"] is True
    assert missing.status_code == 502 and "token ids" in missing.json()["error"]["detail"]


def token_id_logprobs(ids: list[int]) -> dict[str, Any]:
    """vLLM's ``logprobs.content`` with ``return_tokens_as_token_ids``."""
    return {"content": [{"token": f"token_id:{i}", "logprob": -0.5, "top_logprobs": []} for i in ids]}


async def test_prompt_ids_from_tokenize_when_the_reply_has_none(
    upstream_client: UpstreamClient, upstream: FakeUpstream
) -> None:
    upstream.will(completion({"content": "hi"}, logprobs=token_id_logprobs([5, 6, 2])))
    upstream.will({"count": 3, "max_model_len": 99, "tokens": [1, 2, 3]}, path="/tokenize")
    async with upstream_client(return_token_ids=True) as http:
        reply = await http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                              "tools": TOOLS})
    message = reply.json()["choices"][0]["message"]
    assert (message["prompt_token_ids"], message["generation_token_ids"]) == ([1, 2, 3], [5, 6, 2])
    assert message["generation_log_probs"] == [-0.5, -0.5, -0.5]
    chat_sent, tokenize_sent = upstream.requests[0][2], upstream.requests[1][2]
    assert chat_sent["top_logprobs"] == 0 and chat_sent["return_tokens_as_token_ids"] is True
    assert upstream.requests[1][0] == "/tokenize"  # vLLM serves it beside /v1
    assert tokenize_sent == {"model": "big-model", "messages": [{"role": "user", "content": "x"}], "tools": TOOLS}


@pytest.mark.parametrize(
    ("reply", "words"),
    [
        (completion({"content": "hi"}, prompt_token_ids=[1]), "partial token ids: no choice token_ids"),
        ({**completion({"content": "hi"}, token_ids=[5]), "prompt_token_ids": [1]}, "logprobs do not match"),
        (completion({"content": "hi"}, token_ids=[5], prompt_token_ids=[1], logprobs=token_id_logprobs([6])),
         "disagree with its logprob tokens"),
        (completion({"content": "hi"}, logprobs={"content": [{"token": "h", "logprob": -1.0}]}), "returned none"),
    ],
)
async def test_unusable_token_replies_are_502(
    upstream_client: UpstreamClient, upstream: FakeUpstream, reply: dict[str, Any], words: str
) -> None:
    upstream.will(reply)
    async with upstream_client(return_token_ids=True) as http:
        answer = await http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
    assert answer.status_code == 502 and words in answer.json()["error"]["detail"]


async def test_a_server_that_retokenizes_known_ids_is_refused(
    upstream_client: UpstreamClient, upstream: FakeUpstream
) -> None:
    """The server's /tokenize kept the earlier turn's ids, but its generation used others."""
    history = [{"role": "user", "content": "x"},
               {"role": "assistant", "content": "y", "prompt_token_ids": [1, 2], "generation_token_ids": [3]},
               {"role": "user", "content": "z"}]
    upstream.will({"count": 5, "max_model_len": 99, "tokens": [1, 2, 3, 4, 9]}, path="/tokenize")
    upstream.will(completion({"content": "ok"}, token_ids=[7], prompt_token_ids=[1, 2, 8, 4, 9],
                             logprobs=token_id_logprobs([7])))
    async with upstream_client(return_token_ids=True) as http:
        answer = await http.post("/v1/chat/completions", json={"messages": history})
    assert answer.status_code == 502 and "tokenized the known ids" in answer.json()["error"]["detail"]
    assert [path for path, _, _ in upstream.requests] == ["/tokenize", "/v1/chat/completions"]


@pytest.mark.parametrize(
    ("status", "ours", "code"),
    [
        (400, 400, "invalid_request"),
        (401, 502, "upstream_error"),
        (503, 503, "unavailable"),
        (500, 502, "upstream_error"),
    ],
)
async def test_upstream_errors(
    upstream_client: UpstreamClient, upstream: FakeUpstream, status: int, ours: int, code: str
) -> None:
    upstream.will((status, {"error": {"message": "context too long", "type": "x", "code": None}}))
    async with upstream_client() as http:
        reply = await http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
    assert reply.status_code == ours
    assert reply.json()["error"]["code"] == code and "context too long" in reply.json()["error"]["detail"]


async def test_stream_replays_the_reply(upstream_client: UpstreamClient, upstream: FakeUpstream) -> None:
    upstream.will(completion({"content": "It is 3."}))
    async with upstream_client() as http:
        reply = await http.post(
            "/v1/chat/completions", json={"stream": True, "messages": [{"role": "user", "content": "x"}]}
        )
    events = [line.removeprefix("data: ") for line in reply.text.split("\n\n") if line]
    assert events[-1] == "[DONE]"
    chunks = [ChatCompletionChunk.model_validate(orjson.loads(e)) for e in events[:-1]]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "It is 3."
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_config_needs_exactly_one_backend() -> None:
    ref = {"type": "responses_api_models", "name": "inference_worker"}
    for settings, words in [
        ({}, "exactly one"),
        ({"upstream": UPSTREAM, "worker": ref}, "exactly one"),
        ({"upstream": UPSTREAM, "tokenizer_path": "/x"}, "tokenizer_path"),
        ({"upstream": {**UPSTREAM, "base_url": "upstream:8000"}}, "base_url"),
        ({"upstream": UPSTREAM, "temprature": 0.5}, "unknown key"),
    ]:
        with pytest.raises(ConfigError, match=words):
            load_config_dict({"policy_model": {"responses_api_models": {"policy_model": settings}}})
