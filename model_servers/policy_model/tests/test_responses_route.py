"""``/v1/responses`` in process against the scripted worker, and the item <-> message conversion."""

from __future__ import annotations

import re
from typing import Any

import pytest
from openai.types.responses import Response

from model_servers.inference_worker import default_model_data as data
from model_servers.policy_model.chat_format import ChatFormat
from model_servers.policy_model.responses_convert import request_messages
from model_servers.policy_model.schemas import ResponsesRequest
from model_servers.policy_model.tests.conftest import PolicyClient
from model_servers.policy_model.tests.scripted_worker import ScriptedWorker

pytestmark = pytest.mark.unit

CALL = '<tool_call>{"name":"add","arguments":{"a":40,"b":2}}</tool_call>'
TOOLS = [{"type": "function", **tool["function"]} for tool in data.TOOLS]
QUESTION = "What is 40 plus 2?"


def body(input_: Any, **extra: Any) -> dict[str, Any]:
    return {"model": "policy", "input": input_, "tools": TOOLS, **extra}


async def test_function_call_output_with_tokens(
    policy_client: PolicyClient, worker: ScriptedWorker, fmt: ChatFormat
) -> None:
    worker.will(CALL)
    async with policy_client() as http:
        reply = await http.post("/v1/responses", json=body(QUESTION, return_token_ids=True))
    assert reply.status_code == 200, reply.text
    response = reply.json()
    Response.model_validate(response)
    assert (response["object"], response["status"], response["incomplete_details"]) == (
        "response",
        "completed",
        None,
    )
    [item] = response["output"]
    assert item["type"] == "function_call" and item["status"] == "completed"
    assert (item["name"], item["arguments"]) == ("add", '{"a":40,"b":2}')
    assert re.fullmatch(r"call_[0-9a-f]{24}", item["call_id"]) and item["id"].startswith("fc_")
    assert item["prompt_token_ids"] == worker.requests[0]["prompt"]
    assert fmt.decode(item["generation_token_ids"]) == CALL + data.END
    assert item["policy_version"] == worker.policy_version
    assert response["usage"]["input_tokens"] == len(item["prompt_token_ids"])
    assert response["tools"][0]["name"] == "add" and response["tool_choice"] == "auto"
    prompt_text = fmt.decode(worker.requests[0]["prompt"])
    assert (
        prompt_text
        == f"<bos><|system|>Tools: add, subtract, multiply<|end|><|user|>{QUESTION}<|end|><|assistant|>"
    )


async def test_second_turn_reuses_the_ids_of_the_items_passed_back(
    policy_client: PolicyClient, worker: ScriptedWorker, fmt: ChatFormat
) -> None:
    worker.will("Thinking. " + CALL, "The answer is 42.")
    async with policy_client(return_token_ids=True) as http:
        first = (await http.post("/v1/responses", json=body([{"role": "user", "content": QUESTION}]))).json()
        assert [item["type"] for item in first["output"]] == ["message", "function_call"]
        call = first["output"][1]
        history = [
            {"role": "user", "content": QUESTION},
            *first["output"],
            {"type": "function_call_output", "call_id": call["call_id"], "output": "42"},
        ]
        second = (await http.post("/v1/responses", json=body(history))).json()
    known = call["prompt_token_ids"] + call["generation_token_ids"]
    prompt = worker.requests[1]["prompt"]
    assert prompt[: len(known)] == known
    assert fmt.decode(prompt[len(known) :]) == data.render_tool_result(42)
    [message] = second["output"]
    assert message["type"] == "message" and message["content"][0]["text"] == "The answer is 42."
    assert message["prompt_token_ids"] == prompt


async def test_instructions_and_developer_become_system(
    policy_client: PolicyClient, worker: ScriptedWorker
) -> None:
    worker.will("ok")
    async with policy_client() as http:
        input_ = [
            {
                "type": "message",
                "role": "developer",
                "content": [{"type": "input_text", "text": "Be brief."}],
            },
            {"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
        ]
        await http.post("/v1/responses", json={"input": input_, "instructions": "Use tools."})
    text = worker.fmt.decode(worker.requests[0]["prompt"])
    assert text == "<bos><|system|>Use tools.<|end|><|system|>Be brief.<|end|><|user|>Hi<|end|><|assistant|>"


async def test_length_is_incomplete(policy_client: PolicyClient, worker: ScriptedWorker) -> None:
    worker.will("The answer is 42.")
    async with policy_client() as http:
        response = (await http.post("/v1/responses", json=body(QUESTION, max_output_tokens=3))).json()
    Response.model_validate(response)
    assert response["status"] == "incomplete"
    assert response["incomplete_details"] == {"reason": "max_output_tokens"}
    assert response["output"][0]["content"][0]["text"] == "The"
    assert response["output"][0]["status"] == "incomplete"


def test_items_of_one_call_regroup_into_one_assistant_turn() -> None:
    tokens = {
        "prompt_token_ids": [1, 2],
        "generation_token_ids": [3],
        "generation_log_probs": [-0.1],
        "policy_version": 2,
    }
    other = {**tokens, "generation_token_ids": [4]}
    request = ResponsesRequest.model_validate(
        {
            "input": [
                {"role": "user", "content": "q"},
                {
                    "type": "message",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": "a", "annotations": []}],
                    "id": "msg_1",
                    "status": "completed",
                    **tokens,
                },
                {"type": "function_call", "call_id": "c1", "name": "add", "arguments": "{}", **tokens},
                {"type": "function_call", "call_id": "c2", "name": "add", "arguments": "{}", **other},
                {"type": "function_call_output", "call_id": "c1", "output": "1"},
                {"role": "assistant", "content": "plain"},
                {"role": "assistant", "content": "again"},
            ]
        }
    )
    messages = request_messages(request)
    assert [m["role"] for m in messages] == [
        "user",
        "assistant",
        "assistant",
        "tool",
        "assistant",
        "assistant",
    ]
    assert messages[1]["content"] == "a" and [c["id"] for c in messages[1]["tool_calls"]] == ["c1"]
    assert messages[1]["generation_token_ids"] == [3]
    assert messages[2]["generation_token_ids"] == [4] and messages[2]["content"] is None
    assert messages[3] == {"role": "tool", "tool_call_id": "c1", "content": "1"}
    assert "prompt_token_ids" not in messages[4]
