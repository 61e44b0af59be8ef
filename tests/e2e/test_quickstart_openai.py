"""Issue 2 acceptance: the quickstart mesh from YAML, found through the head server, speaks OpenAI."""

from __future__ import annotations

import json
from collections.abc import Callable

import httpx
import openai
import pytest

from nemo_gym_ckpt.launch.launcher import MeshLauncher

pytestmark = pytest.mark.e2e

CALCULATOR = [
    {"type": "function", "name": name, "description": f"{name} two integers",
     "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                    "required": ["a", "b"]}}
    for name in ("add", "subtract", "multiply")
]


def test_the_openai_client_talks_to_the_quickstart_policy_model(
    launch_mesh: Callable[..., MeshLauncher],
) -> None:
    mesh = launch_mesh("configs/quickstart.yaml", ready_timeout_s=120)
    servers = httpx.get(f"{mesh.head_url}/servers", timeout=10).json()
    policy = next(s for s in servers if s["name"] == "policy_model")
    assert policy["type"] == "responses_api_models" and policy["implementation"] == "policy_model"
    client = openai.OpenAI(base_url=f"{policy['url']}/v1", api_key="unused", max_retries=0, timeout=60)

    models = [model.id for model in client.models.list()]
    assert len(models) == 1

    chat = client.chat.completions.create(
        model=models[0], messages=[{"role": "user", "content": "What is 12 plus 30?"}], max_tokens=40)
    assert chat.choices[0].finish_reason in ("stop", "tool_calls", "length")
    assert chat.usage is not None and chat.usage.completion_tokens > 0

    response = client.responses.create(
        model=models[0], input="What is 97 times 53?", tools=CALCULATOR, max_output_tokens=60)  # type: ignore[arg-type]
    calls = [item for item in response.output if item.type == "function_call"]
    assert len(calls) == 1
    assert calls[0].name == "multiply"
    assert json.loads(calls[0].arguments) == {"a": 97, "b": 53}
