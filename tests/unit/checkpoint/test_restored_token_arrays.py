"""Token arrays after a restore from a boundary where the agent was already done, in process.

Records never carry token arrays (docs/protocol.md section 6). A rollout continued from a boundary that
holds the agent's reply (the environment's), or whose agent session holds its completed reply (the
agent's), must still come back with every token array of the uninterrupted run: the environment has
the agent put them back (``POST /v1/responses/refill``), and the agent refills a restored completed
reply that it answers again; neither repeats a model or tool call. The policy model is the
``DeterministicModel`` of ``tests/support/rollout_mesh.py`` with its capture route, reused across
the crash as the stand-in of the policy model's token sidecar (no call is delivered after a commit).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from model_servers.inference_worker.default_model_data import make_problem
from nemo_gym_ckpt.capture import without_token_arrays
from nemo_gym_ckpt.environment.base import TOKEN_ARRAYS
from nemo_gym_ckpt.identity import RolloutIdentity
from nemo_gym_ckpt.testing.clock import FakeClock
from nemo_gym_ckpt.testing.conformance import Control
from nemo_gym_ckpt.testing.placement import InProcess, under_test
from tests.support.episode_participants import TOKEN, WAIT_S, agent_stack, checkpoint_config
from tests.support.rollout_mesh import (
    DeterministicModel,
    calculator_answers,
    calculator_row,
    nim_moves,
    nim_row,
    rollout_mesh,
)

pytestmark = pytest.mark.unit

PROBLEMS = [make_problem(random.Random(seed)) for seed in range(3)]
ENVIRONMENTS = ("single_agent_turn", "nim")


async def until(condition: Callable[[], Any], what: str) -> None:
    """Poll ``condition`` (a deadline, never a sleep to order events)."""
    deadline = time.monotonic() + WAIT_S
    while not await condition():
        assert time.monotonic() < deadline, f"never: {what}"
        await asyncio.sleep(0.001)


def rows_of(environment: str) -> dict[str, dict[str, Any]]:
    if environment == "nim":
        return {f"n{i}": nim_row(stones=9 + i, seed=i) for i in range(2)}
    return {f"c{i}": calculator_row(problem) for i, problem in enumerate(PROBLEMS)}


def model_of(environment: str, hold: Any = None) -> DeterministicModel:
    if environment == "nim":
        return DeterministicModel(nim_moves, hold=hold)
    return DeterministicModel(calculator_answers({p["question"]: p for p in PROBLEMS}), hold=hold)


def last_call_before_the_checkpoint(environment: str) -> Callable[[str | None, dict[str, Any]], bool]:
    """single_agent_turn: the answer (the activation's last call); nim: the second move (activation 2)."""
    def hold(key: str | None, body: dict[str, Any]) -> bool:
        if environment == "nim":
            return sum(1 for item in body["input"] if item.get("role") == "assistant") == 1
        return bool(body["input"][-1].get("type") == "function_call_output")

    return hold


async def uninterrupted(environment: str, root: Path) -> tuple[dict[str, Any], int]:
    model = model_of(environment)
    async with rollout_mesh(environment, root / "plain", model, checkpoint=False) as mesh:
        runs = {rid: mesh.dispatch(row, RolloutIdentity(rid)) for rid, row in rows_of(environment).items()}
        rows = {rid: (await asyncio.wait_for(run, WAIT_S)).json() for rid, run in runs.items()}
    return rows, len(model.calls)


def env_records(directory: Path) -> list[dict[str, Any]]:
    where = directory / "gym" / "environment" / "env"
    manifest = orjson.loads((where / "manifest.json").read_bytes())
    return [orjson.loads(line) for line in (where / manifest["records_file"]).read_bytes().splitlines()]


@pytest.mark.parametrize("environment", ENVIRONMENTS)
async def test_a_rollout_checkpointed_after_its_agent_finished_keeps_every_token_array(
    environment: str, root: Path
) -> None:
    """The checkpoint lands right after an activation completed: the environment's boundary holds
    the agent's reply (token arrays stripped in the record) and the agent session its completed reply."""
    reference, calls = await uninterrupted(environment, root)
    rows = rows_of(environment)
    model = model_of(environment, hold=last_call_before_the_checkpoint(environment))
    directory = root / "late"
    async with rollout_mesh(environment, root, model) as mesh:
        for rid, row in rows.items():
            mesh.dispatch(row, RolloutIdentity(rid))
        await until(lambda: held(model, len(rows)), "every held call awaited")
        async with mesh.coordinator() as coordinator:
            deadline = time.time() + 30
            prepared = await coordinator.prepare("late", deadline_ts=deadline)
            assert prepared.prepared, prepared.to_json()
            model.release()  # each activation completes; its episode parks at the boundary after it

            async def parked_after_the_activation() -> bool:
                env, agent = (await mesh.status("env"))["extras"], (await mesh.status("agent"))["extras"]
                return bool(env["parked"] == len(rows) and agent["running"] == 0)

            await until(parked_after_the_activation, "every episode parked after its activation")
            scope = prepared.continued([RolloutIdentity(rid) for rid in rows])
            await coordinator.commit("late", deadline_ts=deadline, checkpoint_dir=str(directory), episode_ids=scope)
    made = len(model.calls)
    records = env_records(directory)
    after = {"single_agent_turn": "close_agent", "nim": "act"}[environment]
    assert [r["boundary"]["next_step"] for r in records] == [after] * len(rows), records
    assert not any(name in orjson.dumps(records).decode() for name in TOKEN_ARRAYS)
    async with rollout_mesh(environment, root, model) as mesh:  # fresh apps: the crash
        async with mesh.coordinator() as coordinator:
            deadline = time.time() + 30
            restored = await coordinator.restore("back", deadline_ts=deadline, checkpoint_dir=str(directory),
                                                 episode_ids=scope)
            await coordinator.resume("back", deadline_ts=deadline)
        runs = {e.rollout_id: mesh.dispatch(rows[e.rollout_id], e) for e in restored.continued()}
        results = {rid: (await asyncio.wait_for(run, WAIT_S)).json() for rid, run in runs.items()}
        agent = (await mesh.status("agent"))["extras"]
    assert results == reference  # token arrays included
    assert len(model.calls) == calls  # no completed model call was made again
    assert all(key is not None and key.endswith("-a1") for key in model.capture_keys()[made:])
    assert agent["tool_calls"] == 0


async def held(model: DeterministicModel, count: int) -> bool:
    return sum(model.holding.values()) == count


# ---- the agent: a restored completed reply, and the refill route ----------------------------------


PROBLEM = PROBLEMS[0]
BODY = calculator_row(PROBLEM)["responses_create_params"]


async def invoke(client: httpx.AsyncClient, key: str, activation: int) -> httpx.Response:
    return await client.post(f"/ng-rollout/{key}/v1/responses", json=BODY,
                             headers={"x-ng-agent-activation": str(activation)})


async def test_a_restored_completed_activation_answers_its_reply_with_its_token_arrays(
    root: Path, clock: FakeClock
) -> None:
    model = model_of("single_agent_turn")
    placement, config = InProcess(), checkpoint_config(root)
    async with (
        agent_stack("simple_agent", placement, config, clock, model=model, return_token_ids=True) as stack,
        under_test(stack, placement, root, clock, TOKEN) as pt,
    ):
        first = (await invoke(pt.client, "done", 1)).json()
        assert all(name in first["output"][0] for name in TOKEN_ARRAYS)
        control = Control(pt)
        await control.ok("prepare", checkpoint_id="c1")
        await control.ok("commit", checkpoint_id="c1", checkpoint_dir=str(root / "ck"))
    made = len(model.calls)
    async with (
        agent_stack("simple_agent", placement, config, clock, model=model, return_token_ids=True) as stack,
        under_test(stack, placement, root, clock, TOKEN) as pt,
    ):
        control = Control(pt)
        await control.ok("restore", checkpoint_id="back", checkpoint_dir=str(root / "ck"),
                         episode_ids=[{"rollout_id": "done"}])
        await control.ok("resume", checkpoint_id="back")
        again = [(await invoke(pt.client, "done-a1", 1)).json() for _ in range(2)]
        counts = (await control.status())["extras"]
        committed = await _commit_again(control, root / "ck2")
    assert again == [first, first]  # token arrays included, twice
    assert len(model.calls) == made and counts["model_calls"] == 0 and counts["tool_calls"] == 0
    assert committed == (root / "ck" / "gym" / "agent" / "agent").joinpath(_records_file(root / "ck")).read_bytes()


async def _commit_again(control: Control, directory: Path) -> bytes:
    """Commit the restored agent again, in full: its untouched session is exported byte for byte."""
    await control.ok("prepare", checkpoint_id="c2")
    await control.ok("commit", checkpoint_id="c2", checkpoint_dir=str(directory), incremental=False)
    await control.ok("resume", checkpoint_id="c2")
    return (directory / "gym" / "agent" / "agent" / _records_file(directory)).read_bytes()


def _records_file(directory: Path) -> str:
    manifest = orjson.loads((directory / "gym" / "agent" / "agent" / "manifest.json").read_bytes())
    return str(manifest["records_file"])


async def test_the_refill_route_puts_token_arrays_back_without_a_session(root: Path, clock: FakeClock) -> None:
    model = model_of("single_agent_turn")
    placement, config = InProcess(), checkpoint_config(root)
    async with (
        agent_stack("simple_agent", placement, config, clock, model=model, return_token_ids=True) as stack,
        under_test(stack, placement, root, clock, TOKEN) as pt,
    ):
        output = (await invoke(pt.client, "r", 1)).json()["output"]
        assert (await pt.client.post("/ng-rollout/r/close", json={})).json() == {"closed": True}
        stripped = without_token_arrays(output)
        reply = await pt.client.post("/ng-rollout/r-a1/v1/responses/refill", json={"items": stripped})
        assert reply.status_code == 200, reply.text
        assert reply.json() == {"items": output, "refilled": 2}
        assert len(model.calls) == 2  # the two calls of the activation, none made again
        kept = [output[0], *stripped[1:]]  # a run that keeps its arrays must be its call's
        assert (await pt.client.post("/ng-rollout/r/v1/responses/refill", json={"items": kept})).json() == {
            "items": output, "refilled": 1}
        other = [{**output[0], "generation_token_ids": [0]}, *stripped[1:]]
        unchanged = await pt.client.post("/ng-rollout/r/v1/responses/refill", json={"items": other})
        assert unchanged.json() == {"items": other, "refilled": 0}
        for body in ({"items": "x"}, {"items": [], "more": 1}, {}):
            refused = await pt.client.post("/ng-rollout/r/v1/responses/refill", json=body)
            assert refused.status_code == 400 and refused.json()["error"]["code"] == "invalid_request"
        anonymous = await pt.client.post("/v1/responses/refill", json={"items": stripped})
        assert anonymous.status_code == 400 and anonymous.json()["error"]["code"] == "rollout_id_required"
