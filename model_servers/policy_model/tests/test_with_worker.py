"""The policy model in front of the real inference worker on the embedded default model (uvicorn).

Whatever the tiny model writes, the contract holds: the prompt is the rendered chat, the token
fields describe exactly what was generated, and the next turn's prompt starts with the previous
turn's prompt and generation ids.
"""

from __future__ import annotations

import random

import openai
import pytest

from model_servers.inference_worker import default_model_data as data
from model_servers.inference_worker.app import create_app as create_worker_app
from model_servers.inference_worker.model_dir import DEFAULT_MODEL_DIR
from model_servers.policy_model.app import create_app
from model_servers.policy_model.chat_format import load_chat_format
from model_servers.policy_model.tests.uvicorn_server import serving
from nemo_gym_ckpt.client import MeshClient
from nemo_gym_ckpt.config import load_config_dict
from nemo_gym_ckpt.context import ServerContext

pytestmark = pytest.mark.sockets

WORKER_REF = {"type": "responses_api_models", "name": "inference_worker"}
POLICY = {"worker": WORKER_REF, "return_token_ids": True, "temperature": 0.0, "max_tokens": 48}


def context(name: str, worker_port: int | None = None) -> ServerContext:
    """``name``'s context in a mesh of the worker (embedded default model) and the policy model."""
    worker = {"torch_threads": 1} if worker_port is None else {"torch_threads": 1, "port": worker_port}
    mesh = load_config_dict(
        {
            "inference_worker": {"responses_api_models": {"inference_worker": worker}},
            "policy_model": {"responses_api_models": {"policy_model": POLICY}},
        }
    )
    return ServerContext(name, mesh.instance(name).settings, mesh, MeshClient())


async def test_two_turns_on_the_default_model() -> None:
    fmt = load_chat_format(DEFAULT_MODEL_DIR)
    question = data.make_problem(random.Random(11))["question"]
    async with serving(create_worker_app(context("inference_worker"))) as worker_port:
        ctx = context("policy_model", worker_port)
        async with ctx.client, serving(create_app(ctx)) as port:
            client = openai.AsyncOpenAI(
                base_url=f"http://127.0.0.1:{port}/v1", api_key="-", max_retries=0, timeout=60
            )
            async with client:
                messages: list = [{"role": "user", "content": question}]
                first = await client.chat.completions.create(
                    model="nemo-gym-ckpt-tiny", messages=messages, tools=data.TOOLS
                )
                turn = first.choices[0].message
                fields = turn.model_extra or {}
                assert fmt.decode(fields["prompt_token_ids"]) == fmt.render(messages, data.TOOLS)
                assert len(fields["generation_log_probs"]) == len(fields["generation_token_ids"])
                assert first.usage is not None
                assert first.usage.completion_tokens == len(fields["generation_token_ids"])
                assert fields["policy_version"] == 0
                if first.choices[0].finish_reason != "length":
                    assert fmt.decode(fields["generation_token_ids"][-1:]) == data.END
                messages.append(turn.model_dump(exclude_none=True))
                for call in turn.tool_calls or []:
                    messages.append({"role": "tool", "tool_call_id": call.id, "content": "42"})
                if not turn.tool_calls:
                    messages.append({"role": "user", "content": "Thanks."})
                second = await client.chat.completions.create(
                    model="nemo-gym-ckpt-tiny", messages=messages, tools=data.TOOLS
                )
    known = fields["prompt_token_ids"] + fields["generation_token_ids"]
    second_prompt = (second.choices[0].message.model_extra or {})["prompt_token_ids"]
    assert second_prompt[: len(known)] == known
    assert fmt.decode(second_prompt) == fmt.render(
        [{k: v for k, v in m.items() if k not in fields} for m in messages], data.TOOLS
    )


def upstream_context(base_url: str) -> ServerContext:
    """The policy model in upstream mode, fronting ``base_url`` as a vLLM server."""
    settings = {"upstream": {"base_url": base_url, "model": "nemo-gym-ckpt-tiny"}, "return_token_ids": True,
                "temperature": 0.0}
    mesh = load_config_dict({"policy_model": {"responses_api_models": {"policy_model": settings}}})
    return ServerContext("policy_model", mesh.instance("policy_model").settings, mesh, MeshClient())


async def test_upstream_mode_on_the_workers_vllm_surface() -> None:
    """Upstream mode (``upstream.base_url``) in front of the worker's vLLM surface: the ids of turn one
    are the worker's tokenization of the chat, and turn two's prompt starts with them."""
    fmt = load_chat_format(DEFAULT_MODEL_DIR)
    question = data.make_problem(random.Random(7))["question"]
    async with serving(create_worker_app(context("inference_worker"))) as worker_port:
        ctx = upstream_context(f"http://127.0.0.1:{worker_port}/v1")
        async with ctx.client, serving(create_app(ctx)) as port:
            client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-", max_retries=0,
                                        timeout=60)
            async with client:
                messages: list = [{"role": "user", "content": question}]
                first = await client.chat.completions.create(
                    model="nemo-gym-ckpt-tiny", messages=messages, tools=data.TOOLS, max_tokens=40
                )
                turn = first.choices[0].message
                fields = turn.model_extra or {}
                messages.append(turn.model_dump(exclude_none=True))
                messages.extend({"role": "tool", "tool_call_id": call.id, "content": "42"}
                                for call in turn.tool_calls or [])
                if not turn.tool_calls:
                    messages.append({"role": "user", "content": "Thanks."})
                second = await client.chat.completions.create(
                    model="nemo-gym-ckpt-tiny", messages=messages, tools=data.TOOLS, max_tokens=40
                )
    assert fields["prompt_token_ids"] == fmt.encode(fmt.render([{"role": "user", "content": question}], data.TOOLS))
    assert len(fields["generation_log_probs"]) == len(fields["generation_token_ids"]) > 0
    known = fields["prompt_token_ids"] + fields["generation_token_ids"]
    assert (second.choices[0].message.model_extra or {})["prompt_token_ids"][: len(known)] == known
