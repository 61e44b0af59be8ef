"""NeMo Gym's string_match YAML, unchanged, runs as our mesh and grades NeMo Gym's rows as NeMo Gym did.

The wheel's ``resources_servers/string_match/configs/string_match.yaml`` (string_match, its
simple_agent, its legacy_agent relay) plus our policy model config, each app built exactly as a
launched child builds it (``nemo_gym_ckpt.launch.child.build_app``) on real uvicorn servers (the
policy model is a scripted one on the policy model's port). The scripted model answers each of the
wheel's ``data/example.jsonl`` prompts with the text NeMo Gym's model answered in the wheel's
``data/example_rollouts.jsonl``; every row must come back with the reward and the extracted answer
NeMo Gym recorded there.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest

from nemo_gym_ckpt.config import PROJECT_ROOT, MeshConfig, load_config
from nemo_gym_ckpt.launch.child import build_app
from nemo_gym_ckpt.launch.head import ThreadedServer
from nemo_gym_ckpt.launch.launcher import assign_ports
from nemo_gym_ckpt.responses import last_message_text
from nemo_gym_ckpt.testing.scripted_model import ScriptedModel, last_user_text, message

pytestmark = pytest.mark.interop

STRING_MATCH = "resources_servers/string_match"
RELAY = "string_match_environment_server"
POLICY = PROJECT_ROOT / "model_servers" / "policy_model" / "configs" / "policy_model.yaml"
WORKER = PROJECT_ROOT / "model_servers" / "inference_worker" / "configs" / "inference_worker.yaml"


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def graded(ng_root: Path) -> dict[str, dict[str, Any]]:
    """NeMo Gym's graded rollouts, by prompt."""
    rows = read_jsonl(ng_root / STRING_MATCH / "data" / "example_rollouts.jsonl")
    return {last_user_text(row["responses_create_params"]): row for row in rows}


@pytest.fixture(scope="module")
def mesh(ng_root: Path, graded: dict[str, dict[str, Any]]) -> Iterator[MeshConfig]:
    config = assign_ports(load_config([ng_root / STRING_MATCH / "configs" / "string_match.yaml", WORKER, POLICY]))
    answers = {prompt: last_message_text(row["response"]["output"]) or "" for prompt, row in graded.items()}
    model = ScriptedModel(lambda body: [message(answers[last_user_text(body)])])
    with ExitStack() as stack:
        for name, inst in config.instances.items():
            if name == "inference_worker":
                continue
            app = model.app() if name == "policy_model" else build_app(config, name)
            stack.enter_context(ThreadedServer(app, inst.settings.host, int(inst.settings.port or 0), name=name))
        yield config


def test_nemo_gyms_rows_get_nemo_gyms_rewards(
    mesh: MeshConfig, ng_root: Path, graded: dict[str, dict[str, Any]]
) -> None:
    tasks = read_jsonl(ng_root / STRING_MATCH / "data" / "example.jsonl")
    assert len(tasks) == len(graded) == 5
    with httpx.Client(base_url=mesh.url_of(RELAY), timeout=30.0, trust_env=False) as http:
        for index, task in enumerate(tasks):
            reply = http.post(f"/ng-rollout/{index}-0/run", json=task)
            assert reply.status_code == 200, reply.text
            row, theirs = reply.json(), graded[last_user_text(task["responses_create_params"])]
            assert {key: row[key] for key in task} == task
            assert (row["reward"], row["extracted_answer"]) == (theirs["reward"], theirs["extracted_answer"])
