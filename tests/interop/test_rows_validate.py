"""Interop (e): our rows, failure rows, files and NeMo Gym-facing replies, read by NeMo Gym 0.7 itself.

Our collector (``run_plan``) runs a small collection in this process over the real servers' apps
(``single_agent_turn``, ``simple_agent`` asking for token ids, ``calculator_tools``, a scripted policy
model): three tasks twice each plus a task the verifier refuses. Beside its files, the same apps
answer NeMo Gym's episode request (a result and a failure), its resources seed and close, and its
agent-session seed and close. Everything goes, as JSON, to a subprocess of the Python 3.13 venv that
has ``nemo-gym==0.7.0`` installed, which checks with NeMo Gym's own code:

- every output row validates as ``BaseVerifyResponse`` and its ``response`` as ``NeMoGymResponse``;
  items with token arrays become its ``...ForTraining`` items and keep their arrays, and
  ``metadata.policy_versions`` survives NeMo Gym's re-validation;
- every failure row has exactly the failure keys NeMo Gym's collector writes for a failed ``/run``
  (``rollout_collection._agent_request_failure_row``) in its order, then the keys it stamps, and
  its resume reader (``_latest_failure_rows``) finds each failed rollout in our failures file;
- every materialized row validates as ``BaseRunRequest``;
- each aggregate metrics entry validates as ``AggregateMetrics`` and equals, within 1e-9, what
  ``reward_profile.compute_aggregate_metrics`` computes from our rows;
- the episode replies validate as ``BaseEpisodeResponse``; the seed and close replies as
  ``ResourcesSeedSessionResponse``, ``ResourcesCloseSessionResponse``, ``AgentSeedSessionResponse``,
  ``AgentCloseSessionResponse`` (all of them forbid unknown fields).
"""

from __future__ import annotations

import io
import json
import os
import random
import subprocess
from pathlib import Path
from typing import Any

import orjson
import pytest

from agents.simple_agent import app as agent_app
from environment_servers.single_agent_turn import app as env_app
from model_servers.inference_worker.default_model_data import make_problem
from nemo_gym_ckpt.collect.dispatch import Plan, run_plan
from nemo_gym_ckpt.collect.rows import failures_path, materialized_path, metrics_path, read_jsonl
from nemo_gym_ckpt.config import ServerConfig, ServerRef
from nemo_gym_ckpt.testing.scripted_model import ScriptedModel, calculator_policy
from nemo_gym_ckpt.testing.transports import InProcessMesh
from resources_servers.calculator_tools import app as calculator_app

pytestmark = [pytest.mark.interop, pytest.mark.timeout(120)]

PROBLEMS = [make_problem(random.Random(500 + seed)) for seed in range(3)]
TOOLS = [spec.definition() for spec in calculator_app.CalculatorTools.tool_specs.values()]
EPISODE = {"rollout_id": "9-0", "attempt": 0}

CHECK = r"""
import json, math, sys, warnings
from pathlib import Path
warnings.simplefilter("ignore")
from nemo_gym import rollout_collection as rc
from nemo_gym.base_resources_server import (BaseRunRequest, BaseVerifyResponse, ResourcesCloseSessionResponse,
                                            ResourcesSeedSessionResponse)
from nemo_gym.base_responses_api_agent import AgentCloseSessionResponse, AgentSeedSessionResponse
from nemo_gym.config_types import AggregateMetrics
from nemo_gym.episode_types import BaseEpisodeResponse
from nemo_gym.openai_utils import NeMoGymResponse
from nemo_gym.reward_profile import compute_aggregate_metrics

TOKENS = ("prompt_token_ids", "generation_token_ids", "generation_log_probs")
data = json.loads(Path(sys.argv[1]).read_text())
report = {"training_items": 0}

def close(a, b, where):
    if isinstance(a, dict) and isinstance(b, dict):
        assert set(a) == set(b), (where, sorted(set(a) ^ set(b)))
        for key in a:
            close(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, list) and isinstance(b, list):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            close(x, y, f"{where}[{i}]")
    elif isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        assert math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9), (where, a, b)
    else:
        assert a == b, (where, a, b)

for row in data["rows"]:
    verified = BaseVerifyResponse.model_validate(row)
    NeMoGymResponse.model_validate(row["response"])
    dumped = verified.model_dump(mode="json")
    for ours, theirs, model in zip(row["response"]["output"], dumped["response"]["output"],
                                   verified.response.output):
        if all(name in ours for name in TOKENS):
            assert type(model).__name__.endswith("ForTraining"), type(model).__name__
            assert all(theirs[name] == ours[name] for name in TOKENS)
            report["training_items"] += 1
    assert dumped["response"]["metadata"] == row["response"]["metadata"]

failed = rc._agent_request_failure_row(ValueError("boom"), 400)
stamps = ["_ng_task_index", "_ng_rollout_index", "agent_ref", "_ng_attempt_index", "_ng_environment_server",
          "_ng_result_type"]
for row in data["failures"]:
    assert list(row) == [*failed, *stamps], list(row)
    assert row["_ng_failure_class"] in (rc.AGENT_RUN_ERROR_FAILURE_CLASS, rc.AGENT_REQUEST_FAILED_FAILURE_CLASS)
    assert isinstance(row["_ng_failure_http_status"], int) and isinstance(row["_ng_failure_response_body"], str)
latest = rc._latest_failure_rows([Path(data["failures_file"])])
assert set(latest) >= {(row["_ng_task_index"], row["_ng_rollout_index"]) for row in data["failures"]}, latest

for row in data["materialized"]:
    BaseRunRequest.model_validate(row)

for entry in data["aggregate"]:
    AggregateMetrics.model_validate(entry)
    stripped = [{k: v for k, v in row.items() if k not in ("response", "responses_create_params")}
                | {"response": {"usage": row["response"]["usage"]}} for row in data["rows"]]
    theirs = json.loads(compute_aggregate_metrics(stripped).model_dump_json())
    for name in ("agent_metrics", "key_metrics", "group_level_metrics", "repeat_level_metrics"):
        close(entry[name], theirs[name], name)

for reply in data["episodes"]:
    BaseEpisodeResponse.model_validate(reply)
ResourcesSeedSessionResponse.model_validate(data["resources_seed"])
ResourcesCloseSessionResponse.model_validate(data["resources_close"])
AgentSeedSessionResponse.model_validate(data["agent_seed"])
AgentCloseSessionResponse.model_validate(data["agent_close"])
report.update(rows=len(data["rows"]), failures=len(data["failures"]), episodes=len(data["episodes"]))
print(json.dumps(report))
"""


@pytest.fixture(scope="module")
def ng_python() -> str:
    """The Python of a venv with ``nemo-gym==0.7.0`` (``NEMO_GYM_INTEROP_PYTHON``)."""
    python = os.environ.get("NEMO_GYM_INTEROP_PYTHON", "/work/cache/ng07/bin/python")
    if not Path(python).exists():
        pytest.skip(f"no NeMo Gym venv at {python} (set NEMO_GYM_INTEROP_PYTHON)")
    return python


def task(problem: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"responses_create_params": {"input": [{"role": "user", "content": problem["question"]}],
                                        "tools": TOOLS}, "expected_answer": problem["answer"], **extra}


def build_mesh() -> InProcessMesh:
    model = ScriptedModel(calculator_policy({p["question"]: p for p in PROBLEMS}))
    mesh = InProcessMesh({
        "policy_model": ("responses_api_models", "scripted", ServerConfig()),
        "calculator_tools": ("resources_servers", "calculator_tools", calculator_app.Config()),
        "simple_agent": ("responses_api_agents", "simple_agent", agent_app.Config(
            model_server=ServerRef(type="responses_api_models", name="policy_model"),
            resources_server=ServerRef(type="resources_servers", name="calculator_tools"), return_token_ids=True)),
        "env": ("environment_servers", "single_agent_turn", env_app.Config(
            agent_server=ServerRef(type="responses_api_agents", name="simple_agent"),
            resources_server=ServerRef(type="resources_servers", name="calculator_tools"))),
    })
    mesh.serve("policy_model", model.app())
    for name, module in (("calculator_tools", calculator_app), ("simple_agent", agent_app), ("env", env_app)):
        mesh.build(name, module.create_app)
    return mesh


async def replies(mesh: InProcessMesh) -> dict[str, Any]:
    """What the servers answer to NeMo Gym's episode, seed and close requests."""
    client = mesh.client()

    async def post(name: str, path: str, body: Any, **kwargs: Any) -> Any:
        reply = await client.request("POST", mesh.url_of(name) + path, json=body, rollout_prefix=False, check=False,
                                     **kwargs)
        assert reply.status_code == 200, reply.text
        return reply

    episode_task = {"task_id": {"taskset": "calc", "task_id": "t9"}, "task_input": task(PROBLEMS[0])}
    wrong = {**episode_task, "task_input": task(PROBLEMS[0], expected_answer="many")}
    episodes = [(await post("env", "/run", {"episode_id": EPISODE, "task": body})).json()
                for body in (episode_task, wrong)]
    assert "result" in episodes[0] and "failure" in episodes[1]
    seed = {"resources_session_id": "resources-session-9", "episode_id": EPISODE,
            "task_id": episode_task["task_id"], "task_data": {"expected_answer": "1"}}
    resources_seed = await post("calculator_tools", "/seed_session", seed)
    resources_close = await post("calculator_tools", "/close_session",
                                 {"resources_session_id": "resources-session-9", "episode_id": EPISODE})
    access = {"kind": "direct_http", "name": "calculator_tools.direct_http", "required": True,
              "base_url": mesh.url_of("calculator_tools"), "cookies": dict(resources_seed.cookies.items())}
    agent_seed = await post("simple_agent", "/v1/agent_sessions", {
        "agent_session_id": "agent-session-9", "episode_id": EPISODE, "task_id": episode_task["task_id"],
        "tool_accesses": [access]})
    agent_close = await post("simple_agent", "/v1/agent_sessions/close",
                             {"agent_session_id": "agent-session-9", "episode_id": EPISODE},
                             cookies=dict(agent_seed.cookies.items()))
    return {"episodes": episodes, "resources_seed": resources_seed.json(), "resources_close": resources_close.json(),
            "agent_seed": agent_seed.json(), "agent_close": agent_close.json()}


async def test_our_rows_and_replies_validate_against_nemo_gyms_models(ng_python: str, tmp_path: Path) -> None:
    mesh = build_mesh()
    output = tmp_path / "rollouts.jsonl"
    tasks = [task(p) for p in PROBLEMS] + [task(PROBLEMS[0], expected_answer="many")]
    plan = Plan("env", mesh.url_of("env"), tasks, output, num_repeats=2, concurrency=4,
                result_type="single_agent_turn", agent_ref={"type": "responses_api_agents", "name": "simple_agent"})
    summary = await run_plan(plan, mesh.client(), io.StringIO())
    assert (summary.finished, summary.failed) == (6, 2)
    data = {
        "rows": list(read_jsonl(output)), "failures": list(read_jsonl(failures_path(output))),
        "failures_file": str(failures_path(output)), "materialized": list(read_jsonl(materialized_path(output))),
        "aggregate": orjson.loads(metrics_path(output).read_bytes()), **(await replies(mesh)),
    }
    await mesh.aclose()
    payload = tmp_path / "ours.json"
    payload.write_bytes(orjson.dumps(data))
    checked = subprocess.run([ng_python, "-c", CHECK, str(payload)], capture_output=True, text=True, timeout=100,
                             cwd=tmp_path)
    assert checked.returncode == 0, checked.stderr[-4000:]
    report = json.loads(checked.stdout.strip().splitlines()[-1])
    assert report == {"training_items": 12, "rows": 6, "failures": 2, "episodes": 2}, report  # 2 model items a row
