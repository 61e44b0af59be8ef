"""``/v1/chat/completions`` in process against the scripted worker."""

from __future__ import annotations

import re
from typing import Any

import orjson
import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from model_servers.inference_worker import default_model_data as data
from model_servers.policy_model.chat_format import ChatFormat
from model_servers.policy_model.tests.conftest import PolicyClient
from model_servers.policy_model.tests.scripted_worker import ScriptedWorker

pytestmark = pytest.mark.unit

CALL = '<tool_call>{"name":"multiply","arguments":{"a":12,"b":7}}</tool_call>'
QUESTION = {"role": "user", "content": "What is 12 times 7?"}


def chat_body(messages: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"model": "anything", "messages": messages, "tools": data.TOOLS, **extra}


async def test_tool_call_reply_with_token_capture(
    policy_client: PolicyClient, worker: ScriptedWorker, fmt: ChatFormat
) -> None:
    worker.will(CALL)
    async with policy_client() as http:
        reply = await http.post(
            "/v1/chat/completions", json=chat_body([QUESTION], return_token_ids=True, seed=5)
        )
    assert reply.status_code == 200, reply.text
    body = reply.json()
    ChatCompletion.model_validate(body)
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["content"] is None
    [call] = message["tool_calls"]
    assert re.fullmatch(r"call_[0-9a-f]{24}", call["id"])
    assert call["function"] == {"name": "multiply", "arguments": '{"a":12,"b":7}'}
    sent = worker.requests[0]
    assert sent["prompt"] == fmt.encode(fmt.render([QUESTION], data.TOOLS))
    assert (sent["return_token_ids"], sent["logprobs"], sent["skip_special_tokens"], sent["seed"]) == (
        True,
        1,
        False,
        5,
    )
    assert message["prompt_token_ids"] == sent["prompt"]
    assert fmt.decode(message["generation_token_ids"]) == CALL + data.END
    assert len(message["generation_log_probs"]) == len(message["generation_token_ids"])
    assert message["policy_version"] == worker.policy_version
    assert body["usage"] == {
        "prompt_tokens": len(sent["prompt"]),
        "completion_tokens": len(message["generation_token_ids"]),
        "total_tokens": len(sent["prompt"]) + len(message["generation_token_ids"]),
    }


async def test_token_fields_only_when_asked(policy_client: PolicyClient, worker: ScriptedWorker) -> None:
    worker.will("The answer is 84.", "The answer is 84.")
    async with policy_client() as http:
        plain = (await http.post("/v1/chat/completions", json=chat_body([QUESTION]))).json()
    async with policy_client(return_token_ids=True) as http:
        captured = (await http.post("/v1/chat/completions", json=chat_body([QUESTION]))).json()
    assert "prompt_token_ids" not in plain["choices"][0]["message"]
    assert plain["choices"][0]["message"]["content"] == "The answer is 84."
    assert plain["choices"][0]["finish_reason"] == "stop"
    assert "generation_token_ids" in captured["choices"][0]["message"]


async def test_second_turn_prompt_starts_with_first_turn_ids(
    policy_client: PolicyClient, worker: ScriptedWorker, fmt: ChatFormat
) -> None:
    worker.will(CALL, "The answer is 84.")
    async with policy_client(return_token_ids=True) as http:
        first = (await http.post("/v1/chat/completions", json=chat_body([QUESTION]))).json()
        assistant = first["choices"][0]["message"]
        tool = {"role": "tool", "tool_call_id": assistant["tool_calls"][0]["id"], "content": "84"}
        second = await http.post("/v1/chat/completions", json=chat_body([QUESTION, assistant, tool]))
    assert second.status_code == 200, second.text
    known = assistant["prompt_token_ids"] + assistant["generation_token_ids"]
    prompt = worker.requests[1]["prompt"]
    assert prompt[: len(known)] == known
    assert fmt.decode(prompt[len(known) :]) == data.render_tool_result(84)
    assert second.json()["choices"][0]["message"]["content"] == "The answer is 84."


async def test_tool_choice_none_leaves_the_text_alone(
    policy_client: PolicyClient, worker: ScriptedWorker
) -> None:
    worker.will(CALL)
    async with policy_client() as http:
        body = (
            await http.post("/v1/chat/completions", json=chat_body([QUESTION], tool_choice="none"))
        ).json()
    assert body["choices"][0]["message"]["content"] == CALL
    assert "tool_calls" not in body["choices"][0]["message"]
    assert body["choices"][0]["finish_reason"] == "stop"


async def test_max_tokens_cut_is_length(policy_client: PolicyClient, worker: ScriptedWorker) -> None:
    worker.will("The answer is 84.")
    async with policy_client() as http:
        body = (
            await http.post("/v1/chat/completions", json=chat_body([QUESTION], max_completion_tokens=6))
        ).json()
    assert worker.requests[0]["max_tokens"] == 6
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["choices"][0]["message"]["content"] == "The an"


async def test_max_tokens_is_clamped_to_the_context(
    policy_client: PolicyClient, worker: ScriptedWorker
) -> None:
    worker.will("ok")
    async with policy_client(max_tokens=10_000) as http:
        await http.post("/v1/chat/completions", json=chat_body([QUESTION]))
    assert len(worker.requests[0]["prompt"]) + worker.requests[0]["max_tokens"] == 256


async def test_stop_string_ends_the_content(policy_client: PolicyClient, worker: ScriptedWorker) -> None:
    worker.will("The answer is 84. Bye")
    async with policy_client() as http:
        body = (await http.post("/v1/chat/completions", json=chat_body([QUESTION], stop=[" Bye"]))).json()
    assert worker.requests[0]["stop"] == [" Bye"]
    assert body["choices"][0]["message"]["content"] == "The answer is 84."


async def test_rollout_prefix_reaches_the_worker(policy_client: PolicyClient, worker: ScriptedWorker) -> None:
    worker.will("hi")
    async with policy_client() as http:
        reply = await http.post("/ng-rollout/r7-a1/v1/chat/completions", json=chat_body([QUESTION]))
    assert reply.status_code == 200
    assert worker.capture_keys == ["r7-a1"]


async def test_models(policy_client: PolicyClient) -> None:
    async with policy_client() as http:
        body = (await http.get("/v1/models")).json()
    assert body["data"][0]["id"] == "nemo-gym-ckpt-tiny"  # the worker's served name
    async with policy_client(model_name="policy") as http:
        assert (await http.get("/ng-rollout/r1/v1/models")).json()["data"][0]["id"] == "policy"


def sse_payloads(text: str) -> list[Any]:
    events = [line.removeprefix("data: ") for line in text.split("\n\n") if line.startswith("data: ")]
    return [event if event == "[DONE]" else orjson.loads(event) for event in events]


async def test_stream_content_then_finish(policy_client: PolicyClient, worker: ScriptedWorker) -> None:
    worker.will("The answer is 84.")
    async with policy_client() as http:
        reply = await http.post(
            "/v1/chat/completions",
            json=chat_body(
                [QUESTION], stream=True, stream_options={"include_usage": True}, return_token_ids=True
            ),
        )
    assert reply.headers["content-type"].startswith("text/event-stream")
    payloads = sse_payloads(reply.text)
    assert payloads[-1] == "[DONE]"
    chunks = [ChatCompletionChunk.model_validate(p) for p in payloads[:-1]]
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == "The answer is 84."
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 3  # really incremental
    finish = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert [c.choices[0].finish_reason for c in finish] == ["stop"]
    assert payloads[-3]["choices"][0]["delta"]["generation_token_ids"] == worker.fmt.encode(
        content + data.END
    )
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == len(content) + 1
    assert len({c.id for c in chunks}) == 1
    assert worker.requests[0]["stream"] is True


async def test_stream_tool_calls(policy_client: PolicyClient, worker: ScriptedWorker) -> None:
    worker.will("Let me compute." + CALL)
    async with policy_client() as http:
        reply = await http.post("/v1/chat/completions", json=chat_body([QUESTION], stream=True))
    chunks = [ChatCompletionChunk.model_validate(p) for p in sse_payloads(reply.text)[:-1]]
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert content == "Let me compute."
    calls = [call for c in chunks for call in c.choices[0].delta.tool_calls or []]
    assert [(call.index, call.function.name, call.function.arguments) for call in calls if call.function] == [
        (0, "multiply", '{"a":12,"b":7}')
    ]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
