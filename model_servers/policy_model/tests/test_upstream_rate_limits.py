"""Upstream mode meets a rate limit: an upstream 429 (nothing of the request started there) is sent
again after its ``Retry-After`` within the call's deadline, as worker mode does for the worker's
429; one the deadline leaves no room for is the caller's 429 ``capacity_exceeded`` with a
``Retry-After``, never a 502. The upstream is a stub served by real uvicorn, reached over HTTP
through the mesh client's default transport.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from starlette.responses import JSONResponse

from model_servers.policy_model.app import Config, create_app
from model_servers.policy_model.tests.test_chat_route import sse_payloads
from model_servers.policy_model.tests.uvicorn_server import serving
from nemo_gym_ckpt.client import MeshClient
from nemo_gym_ckpt.config import load_config_dict
from nemo_gym_ckpt.context import ServerContext

pytestmark = pytest.mark.unit

CALL_DEADLINE_S = 30.0  # what a test waits for the policy model's answer at most
USER = {"role": "user", "content": "1+2?"}
LIMITED = {"error": {"message": "Rate limit reached for requests", "type": "requests", "code": "rate_limit_exceeded"}}
ANSWER = {
    "id": "chatcmpl-up", "object": "chat.completion", "created": 1, "model": "big-model",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "It is 3."}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 11, "completion_tokens": 3, "total_tokens": 14},
}


class RateLimitedUpstream:
    """``POST /v1/chat/completions`` answering its scripted replies in order: a 429 (with the given
    ``Retry-After``, or none) or the answer."""

    def __init__(self) -> None:
        self.replies: list[tuple[int, dict[str, Any], dict[str, str]]] = []
        self.requests: list[dict[str, Any]] = []
        self.app = FastAPI()
        self.app.post("/v1/chat/completions")(self._reply)

    def limited(self, retry_after: str | None) -> None:
        self.replies.append((429, LIMITED, {} if retry_after is None else {"retry-after": retry_after}))

    def answers(self) -> None:
        self.replies.append((200, ANSWER, {}))

    async def _reply(self, request: Request) -> JSONResponse:
        self.requests.append(await request.json())
        status, body, headers = self.replies.pop(0)
        return JSONResponse(body, status_code=status, headers=headers)


PolicyOverHttp = Callable[..., AbstractAsyncContextManager[httpx.AsyncClient]]


@pytest.fixture
def upstream() -> RateLimitedUpstream:
    return RateLimitedUpstream()


@pytest.fixture
def policy_over_http(upstream: RateLimitedUpstream) -> PolicyOverHttp:
    """``async with policy_over_http(**settings) as http``: the upstream stub on uvicorn, the policy
    model in process in front of it."""

    @asynccontextmanager
    async def open_client(**settings: Any) -> AsyncIterator[httpx.AsyncClient]:
        async with serving(upstream.app) as port:
            target = {"base_url": f"http://127.0.0.1:{port}/v1", "api_key": "sk-test", "model": "big-model"}
            mesh = load_config_dict(
                {"policy_model": {"responses_api_models": {"policy_model": {"upstream": target, **settings}}}})
            instance = mesh.instance("policy_model")
            assert isinstance(instance.settings, Config)
            client = MeshClient()
            app = create_app(ServerContext("policy_model", instance.settings, mesh, client))
            async with client, app.router.lifespan_context(app):
                transport = httpx.ASGITransport(app=app)
                async with httpx.AsyncClient(transport=transport, base_url="http://policy") as http:
                    yield http

    return open_client


async def _chat(http: httpx.AsyncClient, **fields: Any) -> httpx.Response:
    async with asyncio.timeout(CALL_DEADLINE_S):
        return await http.post("/ng-rollout/r1-a1/v1/chat/completions", json={"messages": [USER], **fields})


@pytest.mark.parametrize("retry_after", ["1", None, "soon"], ids=["retry-after", "missing", "garbage"])
async def test_a_rate_limited_call_is_sent_again_and_answered(
    policy_over_http: PolicyOverHttp, upstream: RateLimitedUpstream, retry_after: str | None
) -> None:
    upstream.limited(retry_after)
    upstream.answers()
    async with policy_over_http() as http:
        reply = await _chat(http)
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["message"]["content"] == "It is 3."
    assert len(upstream.requests) == 2 and upstream.requests[0] == upstream.requests[1]


async def test_a_rate_limited_stream_is_answered_once_admitted(
    policy_over_http: PolicyOverHttp, upstream: RateLimitedUpstream
) -> None:
    upstream.limited("1")
    upstream.answers()
    async with policy_over_http() as http:
        reply = await _chat(http, stream=True)
    assert reply.status_code == 200, reply.text
    chunks = sse_payloads(reply.text)
    assert chunks[-1] == "[DONE]"
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks[:-1] if c["choices"]) == "It is 3."
    assert len(upstream.requests) == 2


async def test_rate_limits_past_the_call_deadline_are_the_callers_429(
    policy_over_http: PolicyOverHttp, upstream: RateLimitedUpstream
) -> None:
    upstream.limited("1")
    upstream.limited("1")
    upstream.answers()  # never asked for: the deadline has no room for a second wait
    async with policy_over_http(request_timeout_s=1.5) as http:
        reply = await _chat(http)
    assert reply.status_code == 429, reply.text
    assert reply.json()["error"]["code"] == "capacity_exceeded" and "Rate limit" in reply.json()["error"]["detail"]
    assert reply.headers["retry-after"] == "1" and len(upstream.requests) == 2


async def test_an_upstream_retry_after_is_capped_and_answered_at_once_when_past_the_deadline(
    policy_over_http: PolicyOverHttp, upstream: RateLimitedUpstream
) -> None:
    upstream.limited("86400")  # a day: capped to 60 s, still past a 5 s deadline, so no wait at all
    upstream.answers()
    async with policy_over_http(request_timeout_s=5) as http:
        reply = await _chat(http)
    assert reply.status_code == 429 and reply.json()["error"]["code"] == "capacity_exceeded", reply.text
    assert reply.headers["retry-after"] == "60" and len(upstream.requests) == 1
