"""legacy_agent in process: the agent's own resources server seeds and verifies; checkpointing as single_agent_turn."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path
from typing import Any

import pytest

from agents.simple_agent import app as agent_app
from environment_servers.legacy_agent import app as legacy_app
from model_servers.inference_worker.default_model_data import make_problem
from nemo_gym_ckpt.config import ServerConfig, ServerRef
from nemo_gym_ckpt.errors import ConfigError
from nemo_gym_ckpt.identity import RolloutIdentity
from nemo_gym_ckpt.testing.placement import checkpoint_config
from nemo_gym_ckpt.testing.scripted_model import ScriptedModel, calculator_policy
from nemo_gym_ckpt.testing.transports import InProcessMesh
from resources_servers.calculator_tools import app as calculator_app

pytestmark = pytest.mark.unit

PROBLEM = make_problem(random.Random(3))
TOKEN = "legacy-test-token"
AGENT_REF = ServerRef(type="responses_api_agents", name="agent")


def build(agent_resources: str | None) -> tuple[InProcessMesh, ScriptedModel]:
    model = ScriptedModel(calculator_policy({PROBLEM["question"]: PROBLEM}))
    resources = ServerRef(type="resources_servers", name=agent_resources) if agent_resources else None
    mesh = InProcessMesh({
        "policy_model": ("responses_api_models", "scripted", ServerConfig()),
        "calculator_tools": ("resources_servers", "calculator_tools", calculator_app.Config()),
        "agent": ("responses_api_agents", "simple_agent", agent_app.Config(
            model_server=ServerRef(type="responses_api_models", name="policy_model"), resources_server=resources)),
        "relay": ("environment_servers", "legacy_agent", legacy_app.Config(agent_server=AGENT_REF)),
    })
    mesh.serve("policy_model", model.app())
    mesh.build("calculator_tools", calculator_app.create_app)
    mesh.build("agent", agent_app.create_app)
    return mesh, model


def row() -> dict[str, Any]:
    tools = [spec.definition() for spec in calculator_app.CalculatorTools.tool_specs.values()]
    return {"responses_create_params": {"input": [{"role": "user", "content": PROBLEM["question"]}], "tools": tools},
            "expected_answer": PROBLEM["answer"]}


async def test_the_relay_verifies_on_the_resources_server_its_agent_names() -> None:
    mesh, model = build("calculator_tools")
    mesh.build("relay", legacy_app.create_app)
    reply = await mesh.client().request("POST", mesh.url_of("relay") + "/run", json=row(),
                                        identity=RolloutIdentity("7-0"), check=False)
    assert reply.status_code == 200, reply.text
    result = reply.json()
    assert result["reward"] == 1.0 and result["extracted_answer"] == PROBLEM["answer"]
    assert [item["type"] for item in result["response"]["output"]] == [
        "function_call", "function_call_output", "message"]
    assert {call.capture_key for call in model.calls} == {"7-0"}
    await mesh.aclose()


async def test_with_checkpointing_on_the_relay_is_an_environment_participant(root: Path) -> None:
    mesh, _ = build("calculator_tools")
    mesh.mesh = dataclasses.replace(mesh.mesh, checkpoint=checkpoint_config(root, TOKEN))
    mesh.build("relay", legacy_app.create_app)
    status = await mesh.client().request("GET", mesh.url_of("relay") + "/ng-control/v1/checkpoint/status",
                                         headers={"authorization": f"Bearer {TOKEN}"}, rollout_prefix=False)
    assert status.json()["kind"] == "environment"
    await mesh.aclose()


async def test_an_agent_without_a_resources_server_is_a_config_error() -> None:
    mesh, _ = build(None)
    with pytest.raises(ConfigError, match="agent 'agent' names no resources_server"):
        mesh.build("relay", legacy_app.create_app)
    await mesh.aclose()
