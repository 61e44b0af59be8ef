"""The environment server's NeMo Gym 0.7 surface, in process (docs/nemo-gym.md, "Servers' API").

A flat row as NeMo Gym's collector sends it (no ``/ng-rollout/`` prefix; ``_ng_task_index``,
``_ng_rollout_index``, ``_ng_attempt_index`` in the body) names its rollout, with checkpointing off
and on (admitted, waiting while a checkpoint is open); a prefix that names another rollout is a
400. NeMo Gym's episode request ``{episode_id, task}`` answers ``{episode_id, task_id, result}`` or,
when the episode fails, ``{episode_id, task_id, failure}`` with NeMo Gym's failure fields.
``POST /aggregate_metrics`` answers ``AggregateMetrics``.
"""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path
from typing import Any

import pytest

from model_servers.inference_worker.default_model_data import make_problem
from nemo_gym_ckpt.aggregate_metrics import aggregate_metrics
from nemo_gym_ckpt.identity import RolloutIdentity
from tests.support.rollout_mesh import (
    DeterministicModel,
    RolloutMesh,
    calculator_answers,
    calculator_row,
    rollout_mesh,
)

pytestmark = pytest.mark.unit

PROBLEMS = [make_problem(random.Random(300 + seed)) for seed in range(3)]
AGENT_REF = {"type": "responses_api_agents", "name": "agent"}
WAIT_S = 10.0


def model() -> DeterministicModel:
    return DeterministicModel(calculator_answers({p["question"]: p for p in PROBLEMS}))


async def post(mesh: RolloutMesh, path: str, body: Any, identity: RolloutIdentity | None = None) -> Any:
    return await mesh.client.request("POST", mesh.urls["env"] + path, json=body, identity=identity,
                                     rollout_prefix=identity is not None, check=False, timeout_s=WAIT_S)


@pytest.mark.parametrize("checkpoint", [False, True])
async def test_a_collector_row_names_its_rollout_in_the_body(tmp_path: Path, checkpoint: bool) -> None:
    deterministic = model()
    task = calculator_row(PROBLEMS[0])
    async with rollout_mesh("single_agent_turn", tmp_path, deterministic, checkpoint=checkpoint) as mesh:
        body = {**task, "agent_ref": AGENT_REF, "_ng_task_index": 3, "_ng_rollout_index": 1}
        reply = await post(mesh, "/run", body)
        assert reply.status_code == 200, reply.text
        row = reply.json()
        assert row["reward"] == 1.0 and row["agent_ref"] == AGENT_REF
        assert not [key for key in row if key.startswith("_ng_")]  # the collector stamps its own keys
        assert set(deterministic.capture_keys()) == {"3-1"}
        again = await post(mesh, "/run", {**body, "_ng_attempt_index": 2})
        assert again.status_code == 200, again.text
        assert set(deterministic.capture_keys()) == {"3-1", "3-1-a2"}


async def test_a_prefix_naming_another_rollout_than_the_body_is_refused(tmp_path: Path) -> None:
    async with rollout_mesh("single_agent_turn", tmp_path, model(), checkpoint=False) as mesh:
        body = {**calculator_row(PROBLEMS[0]), "_ng_task_index": 3, "_ng_rollout_index": 1}
        reply = await post(mesh, "/run", body, RolloutIdentity("3-1", 1))
        assert (reply.status_code, reply.json()["error"]["code"]) == (400, "invalid_request")
        assert "prefix names 3-1-a1" in reply.json()["error"]["detail"]
        for bad in ({"_ng_task_index": "3", "_ng_rollout_index": 1}, {"_ng_task_index": 3},
                    {"_ng_task_index": 0, "_ng_rollout_index": 0, "_ng_attempt_index": -1}):
            refused = await post(mesh, "/run", {**calculator_row(PROBLEMS[0]), **bad})
            assert (refused.status_code, refused.json()["error"]["code"]) == (400, "invalid_request"), bad
        same = await post(mesh, "/run", body, RolloutIdentity("3-1"))
        assert same.status_code == 200, same.text


async def test_checkpointing_on_a_body_identity_is_admitted_and_waits_for_resume(tmp_path: Path) -> None:
    async with rollout_mesh("single_agent_turn", tmp_path, model()) as mesh:
        anonymous = await post(mesh, "/run", calculator_row(PROBLEMS[0]))
        assert (anonymous.status_code, anonymous.json()["error"]["code"]) == (400, "rollout_id_required")
        coordinator = mesh.coordinator()
        deadline = time.time() + 60
        prepared = await coordinator.prepare("ck-1", deadline_ts=deadline)
        assert prepared.prepared
        body = {**calculator_row(PROBLEMS[1]), "_ng_task_index": 0, "_ng_rollout_index": 0}
        waiting = asyncio.create_task(post(mesh, "/run", body))
        async with asyncio.timeout(WAIT_S):
            while (await mesh.status("env"))["waiting_requests"] != 1:
                await asyncio.sleep(0.01)
        assert not waiting.done() and mesh.model.calls == []
        await coordinator.resume("ck-1", deadline_ts=deadline)
        reply = await asyncio.wait_for(waiting, WAIT_S)
        assert reply.status_code == 200 and reply.json()["reward"] == 1.0
        assert set(mesh.model.capture_keys()) == {"0-0"}
        await coordinator.aclose()


def episode(task_input: dict[str, Any], rollout_id: str = "7-0", attempt: int = 0) -> dict[str, Any]:
    return {"episode_id": {"rollout_id": rollout_id, "attempt": attempt},
            "task": {"task_id": {"taskset": "calc", "task_id": "t7"}, "task_input": task_input}}


@pytest.mark.parametrize("checkpoint", [False, True])
async def test_an_episode_request_answers_nemo_gyms_episode_response(tmp_path: Path, checkpoint: bool) -> None:
    deterministic = model()
    async with rollout_mesh("single_agent_turn", tmp_path, deterministic, checkpoint=checkpoint) as mesh:
        task = calculator_row(PROBLEMS[0])
        reply = await post(mesh, "/run", episode(task, attempt=1))
        assert reply.status_code == 200, reply.text
        answer = reply.json()
        assert list(answer) == ["episode_id", "task_id", "result"]
        assert answer["episode_id"] == {"rollout_id": "7-0", "attempt": 1}
        assert answer["task_id"] == {"taskset": "calc", "task_id": "t7"}
        assert answer["result"]["reward"] == 1.0 and answer["result"]["expected_answer"] == task["expected_answer"]
        assert set(deterministic.capture_keys()) == {"7-0-a1"}
        # NeMo Gym's single-agent task input: the task's own fields under task_data
        folded = {"responses_create_params": task["responses_create_params"],
                  "task_data": {"expected_answer": task["expected_answer"]}}
        second = (await post(mesh, "/run", episode(folded, "8-0"))).json()
        assert second["result"]["reward"] == 1.0 and second["result"]["expected_answer"] == task["expected_answer"]


async def test_a_failed_episode_is_a_failure_reply_and_a_bad_request_a_400(tmp_path: Path) -> None:
    async with rollout_mesh("single_agent_turn", tmp_path, model(), checkpoint=False) as mesh:
        wrong = {**calculator_row(PROBLEMS[0]), "expected_answer": "many"}  # verify refuses it
        reply = await post(mesh, "/run", episode(wrong))
        assert reply.status_code == 200, reply.text
        answer = reply.json()
        assert list(answer) == ["episode_id", "task_id", "failure"]
        failure = answer["failure"]
        assert failure["failure_reason"].startswith("step verify failed")
        assert (failure["terminal"], failure["failure_kind"], failure["stage"]) == (
            True, "invalid_request", "verification")
        for bad in ({**episode(wrong), "extra": 1}, episode({"no": "params"}),
                    {"episode_id": {"rollout_id": "bad id"}, "task": episode(wrong)["task"]},
                    {"episode_id": {"rollout_id": "7-0"}, "task": {"task_id": {"taskset": "x"}, "task_input": {}}}):
            refused = await post(mesh, "/run", bad)
            assert (refused.status_code, refused.json()["error"]["code"]) == (400, "invalid_request"), bad


async def test_aggregate_metrics_answers_nemo_gyms_shape(tmp_path: Path) -> None:
    rows = [{"_ng_task_index": t, "_ng_rollout_index": r, "reward": float((t + r) % 2)} for t in range(3)
            for r in range(2)]
    async with rollout_mesh("single_agent_turn", tmp_path, model(), checkpoint=False) as mesh:
        reply = await post(mesh, "/aggregate_metrics", {"verify_responses": rows})
        assert reply.status_code == 200, reply.text
        assert reply.json() == aggregate_metrics(rows)
        assert set(reply.json()) == {"group_level_metrics", "agent_metrics", "key_metrics", "perf_summary",
                                     "repeat_level_metrics"}
        assert reply.json()["key_metrics"] == {"mean/reward": 0.5}
        for bad in ({}, {"verify_responses": {}}, {"verify_responses": [1]}, {"verify_responses": [], "x": 1}):
            refused = await post(mesh, "/aggregate_metrics", bad)
            assert (refused.status_code, refused.json()["error"]["code"]) == (400, "invalid_request"), bad
