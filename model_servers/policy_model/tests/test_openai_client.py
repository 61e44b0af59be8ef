"""The official ``openai`` client against the policy model on real uvicorn (worker on uvicorn too)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import openai
import pytest

from model_servers.inference_worker import default_model_data as data
from model_servers.policy_model.app import create_app
from model_servers.policy_model.tests.conftest import WORKER_REF, policy_ctx
from model_servers.policy_model.tests.scripted_worker import ScriptedWorker
from model_servers.policy_model.tests.uvicorn_server import serving
from nemo_gym_ckpt.client import MeshClient

pytestmark = pytest.mark.sockets

CALL = '<tool_call>{"name":"add","arguments":{"a":40,"b":2}}</tool_call>'
RESPONSES_TOOLS = [{"type": "function", **tool["function"]} for tool in data.TOOLS]


@asynccontextmanager
async def policy_server(worker: ScriptedWorker, tokenizer_dir: Path) -> AsyncIterator[openai.AsyncOpenAI]:
    async with serving(worker.app) as worker_port, MeshClient() as mesh_client:
        ctx = policy_ctx(
            mesh_client,
            worker_port=worker_port,
            worker=WORKER_REF,
            tokenizer_path=str(tokenizer_dir),
            return_token_ids=True,
        )
        async with serving(create_app(ctx)) as port:
            client = openai.AsyncOpenAI(
                base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=10
            )
            async with client:
                yield client


async def test_chat_completions_with_the_openai_client(worker: ScriptedWorker, tokenizer_dir: Path) -> None:
    worker.will(CALL, "The answer is 42.", "The answer is 42.")
    async with policy_server(worker, tokenizer_dir) as client:
        models = await client.models.list()
        assert [m.id for m in models.data] == ["nemo-gym-ckpt-tiny"]
        messages: list = [{"role": "user", "content": "What is 40 plus 2?"}]
        first = await client.chat.completions.create(
            model="nemo-gym-ckpt-tiny", messages=messages, tools=data.TOOLS
        )
        choice = first.choices[0]
        assert choice.finish_reason == "tool_calls"
        [call] = choice.message.tool_calls or []
        assert call.function.name == "add" and call.function.arguments == '{"a":40,"b":2}'
        extra = choice.message.model_extra or {}
        assert extra["prompt_token_ids"] == worker.requests[0]["prompt"]
        messages += [
            choice.message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": "42"},
        ]
        second = await client.chat.completions.create(
            model="m", messages=messages, tools=data.TOOLS, max_completion_tokens=64
        )
        assert second.choices[0].message.content == "The answer is 42."
        known = extra["prompt_token_ids"] + extra["generation_token_ids"]
        assert worker.requests[1]["prompt"][: len(known)] == known
        stream = await client.chat.completions.create(
            model="m", messages=messages, stream=True, stream_options={"include_usage": True}
        )
        chunks = [chunk async for chunk in stream]
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "The answer is 42."
        assert chunks[-1].usage is not None


async def test_responses_with_the_openai_client(worker: ScriptedWorker, tokenizer_dir: Path) -> None:
    worker.will(CALL, "The answer is 42.")
    async with policy_server(worker, tokenizer_dir) as client:
        first = await client.responses.create(model="m", input="What is 40 plus 2?", tools=RESPONSES_TOOLS)
        assert first.status == "completed"
        [call] = first.output
        assert call.type == "function_call" and call.name == "add" and call.arguments == '{"a":40,"b":2}'
        history: list = [
            {"role": "user", "content": "What is 40 plus 2?"},
            call.model_dump(exclude_none=True),
            {"type": "function_call_output", "call_id": call.call_id, "output": "42"},
        ]
        second = await client.responses.create(model="m", input=history, tools=RESPONSES_TOOLS)
        assert second.output_text == "The answer is 42."
        assert second.usage is not None and second.usage.input_tokens == len(worker.requests[1]["prompt"])
        known = (call.model_extra or {})["prompt_token_ids"] + (call.model_extra or {})[
            "generation_token_ids"
        ]
        assert worker.requests[1]["prompt"][: len(known)] == known
        with pytest.raises(openai.BadRequestError):
            await client.responses.create(model="m", input="hi", tool_choice="required")
