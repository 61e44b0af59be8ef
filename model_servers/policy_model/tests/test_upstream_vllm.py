"""Upstream mode in front of a vLLM server: our inference worker serving vLLM's surface stands in.

The worker app runs in process (``httpx.ASGITransport``) with a scripted engine on the embedded
model's real tokenizer and chat template, behind a recorder of the requests it gets. The policy
model must ask for vLLM's token fields, take the ids from the reply, and keep the ids of earlier
turns exactly: by the chat path when the server's tokenization starts with them, else by an id
prompt on ``/v1/completions``. (``test_with_worker`` runs this on uvicorn with the real engine.)
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import httpx
import pytest
from starlette.types import Message, Receive, Scope, Send

from model_servers.inference_worker.app import create_app as create_worker_app
from model_servers.inference_worker.hf_tokenizer import HFTokenizer
from model_servers.inference_worker.model_dir import DEFAULT_MODEL_DIR
from model_servers.inference_worker.tests.conftest import make_ctx
from model_servers.inference_worker.tests.scripted_engine import ScriptedEngine
from model_servers.policy_model.app import Config, create_app
from nemo_gym_ckpt.client import MeshClient
from nemo_gym_ckpt.config import load_config_dict
from nemo_gym_ckpt.context import ServerContext

pytestmark = pytest.mark.unit

SERVED = "nemo-gym-ckpt-tiny"
TOKENIZER = HFTokenizer.load(DEFAULT_MODEL_DIR)
EOS = 7
QUESTION = {"role": "user", "content": "What is 2 plus 3?"}
CALL = '<tool_call>{"name":"add","arguments":{"a":2,"b":3}}</tool_call>'


def spelled(text: str) -> list[int]:
    """One id per character: the tags spelled out, which is not how the tokenizer encodes them."""
    return [TOKENIZER.encode(char, add_special_tokens=False)[0] for char in text]


class Recorder:
    """An ASGI app in front of another that records each request's path and JSON body."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.requests: list[tuple[str, dict[str, Any]]] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        more = True
        while more:
            message = await receive()
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        body = b"".join(chunks)
        self.requests.append((scope["path"], json.loads(body) if body else {}))
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    def paths(self) -> list[str]:
        return [path for path, _ in self.requests]


def policy_context(client: MeshClient, base_url: str = "http://worker/v1") -> ServerContext[Config]:
    settings = {"upstream": {"base_url": base_url, "model": SERVED}, "return_token_ids": True, "temperature": 0.0}
    mesh = load_config_dict({"policy_model": {"responses_api_models": {"policy_model": settings}}})
    instance = mesh.instance("policy_model")
    assert isinstance(instance.settings, Config)
    return ServerContext("policy_model", instance.settings, mesh, client)


Front = Callable[..., AbstractAsyncContextManager[tuple[httpx.AsyncClient, Recorder]]]


@pytest.fixture
def front() -> Front:
    """``async with front(script) as (http, worker)``: the policy model (upstream mode) in front of
    the worker app generating ``script``; ``worker.requests`` is what the worker got."""

    @asynccontextmanager
    async def open_front(script: list[int]) -> AsyncIterator[tuple[httpx.AsyncClient, Recorder]]:
        engine = ScriptedEngine(script, tokenizer=TOKENIZER, context_length=512)

        async def factory(_: Any) -> ScriptedEngine:
            return engine

        worker_app = create_worker_app(make_ctx(), engine_factory=factory)
        recorder = Recorder(worker_app)
        client = MeshClient(transport=httpx.ASGITransport(app=recorder))
        app = create_app(policy_context(client))
        async with worker_app.router.lifespan_context(worker_app), client, app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://policy", timeout=10) as http:
                yield http, recorder

    return open_front


async def chat(http: httpx.AsyncClient, messages: list[dict[str, Any]], **body: Any) -> dict[str, Any]:
    reply = await http.post("/v1/chat/completions", json={"messages": messages, **body})
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]


def rendered_ids(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
    from model_servers.inference_worker.engine import ChatTemplateRequest

    text = TOKENIZER.render_chat(messages, ChatTemplateRequest(tools=tools))
    return TOKENIZER.encode(text, add_special_tokens=False)


async def test_first_turn_asks_for_vllm_token_fields(front: Front) -> None:
    script = [*TOKENIZER.encode("It is 5.", add_special_tokens=False), EOS]
    async with front(script) as (http, worker):
        choice = await chat(http, [QUESTION])
    message = choice["message"]
    assert message["content"] == "It is 5." and choice["finish_reason"] == "stop"
    assert message["prompt_token_ids"] == rendered_ids([QUESTION])
    assert message["generation_token_ids"] == script
    assert message["generation_log_probs"] == pytest.approx([-0.01 * (i + 1) for i in range(len(script))])
    assert worker.paths() == ["/v1/chat/completions"]  # the ids came inline: no /tokenize
    sent = worker.requests[0][1]
    assert {k: sent[k] for k in ("logprobs", "top_logprobs", "return_tokens_as_token_ids", "return_token_ids")} == {
        "logprobs": True, "top_logprobs": 0, "return_tokens_as_token_ids": True, "return_token_ids": True}
    assert sent["model"] == SERVED and sent["messages"] == [QUESTION]


async def test_canonical_history_stays_on_the_chat_path(front: Front) -> None:
    script = [*TOKENIZER.encode("It is 5.", add_special_tokens=False), EOS]
    async with front(script) as (http, worker):
        first = (await chat(http, [QUESTION]))["message"]
        history = [QUESTION, first, {"role": "user", "content": "Thanks."}]
        second = (await chat(http, history))["message"]
    known = first["prompt_token_ids"] + first["generation_token_ids"]
    assert second["prompt_token_ids"][: len(known)] == known
    assert worker.paths() == ["/v1/chat/completions", "/tokenize", "/v1/chat/completions"]
    tokenize = worker.requests[1][1]
    assert tokenize["messages"][1] == {"role": "assistant", "content": "It is 5."}  # no token fields sent


async def test_non_canonical_history_is_sent_as_ids(front: Front) -> None:
    """The model spelled the tool-call tags character by character; tokenizing the history again would
    merge them into single tokens. The next prompt must start with the ids the model produced."""
    script = [*spelled(CALL), EOS]
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    async with front(script) as (http, worker):
        first = await chat(http, [QUESTION], tools=tools)
        message = first["message"]
        assert first["finish_reason"] == "tool_calls" and message["tool_calls"][0]["function"]["name"] == "add"
        history = [QUESTION, message, {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"],
                                       "content": "5"}]
        second = await chat(http, history, tools=tools)
    known = message["prompt_token_ids"] + message["generation_token_ids"]
    plain = [{k: v for k, v in m.items() if k not in ("prompt_token_ids", "generation_token_ids",
                                                      "generation_log_probs", "policy_version")} for m in history]
    retokenized = rendered_ids(plain, tools)
    assert retokenized[: len(known)] != known  # the server's own tokenization would have lost them
    prompt = second["message"]["prompt_token_ids"]
    assert prompt[: len(known)] == known
    assert TOKENIZER.decode(prompt, skip_special_tokens=False) == TOKENIZER.decode(retokenized,
                                                                                    skip_special_tokens=False)
    assert worker.paths()[1:] == ["/tokenize", "/detokenize", "/detokenize", "/tokenize", "/v1/completions"]
    completion = worker.requests[-1][1]
    assert completion["prompt"] == prompt and completion["logprobs"] == 0
    assert completion["return_token_ids"] is True and completion["return_tokens_as_token_ids"] is True
    assert second["finish_reason"] == "tool_calls" and second["message"]["generation_token_ids"] == script
    assert second["message"]["tool_calls"][0]["function"]["arguments"] == '{"a":2,"b":3}'


async def test_changed_history_text_cannot_keep_its_ids(front: Front, caplog: pytest.LogCaptureFixture) -> None:
    script = [*TOKENIZER.encode("It is 5.", add_special_tokens=False), EOS]
    async with front(script) as (http, worker):
        first = (await chat(http, [QUESTION]))["message"]
        edited = {**first, "content": "It is 6."}
        with caplog.at_level(logging.WARNING):
            second = (await chat(http, [QUESTION, edited, {"role": "user", "content": "Sure?"}]))["message"]
    assert worker.paths()[1:] == ["/tokenize", "/detokenize", "/detokenize", "/v1/chat/completions"]
    assert second["prompt_token_ids"] == worker_tokenization(worker)
    assert "do not decode to the start of the rendered prompt" in caplog.text


def worker_tokenization(worker: Recorder) -> list[int]:
    """The ids the worker's own rendering gives the last chat it was sent."""
    messages = worker.requests[-1][1]["messages"]
    return rendered_ids(messages)
