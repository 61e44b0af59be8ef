"""Agents as checkpoint participants, in process.

The conformance suite on the simple agent and the restart-only agent; off mounts nothing and
deduplicates nothing; activation deduplication and ordering; boundaries (a model reply awaited is
one, a tool call in flight blocks, calls park during a checkpoint); the loop state exported lazily;
continuation after a restore under the next capture key without repeating a completed call;
retire, close and malformed records.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from nemo_gym_ckpt.agent.sessions import ActivationReply, AgentSessions, Turn
from nemo_gym_ckpt.checkpoint.models import CommitRequest, ControlRequest
from nemo_gym_ckpt.checkpoint.participant import Participant
from nemo_gym_ckpt.checkpoint.store import CheckpointStore, StopSignal
from nemo_gym_ckpt.config import CheckpointConfig
from nemo_gym_ckpt.identity import CURRENT_IDENTITY, RolloutIdentity
from nemo_gym_ckpt.testing.clock import FakeClock
from nemo_gym_ckpt.testing.conformance import CHECKS, Control, ParticipantUnderTest, check_participant
from nemo_gym_ckpt.testing.placement import InProcess, Stack, under_test
from tests.support.episode_participants import TOKEN, WAIT_S, agent_stack, checkpoint_config
from tests.support.rollout_mesh import DeterministicModel, calculator_answers

pytestmark = pytest.mark.unit

AGENTS = ("simple_agent", "restart_only_agent")
RESTART_ONLY_SKIPS = ("restored_content_is_exported_byte_for_byte", "commit_scope_limits_the_export")
PROBLEM = {"question": "What is 2 + 3?", "tool": "add", "arguments": {"a": 2, "b": 3}, "answer": 5}
AUTH = {"authorization": f"Bearer {TOKEN}"}
BODY = {"input": [{"role": "user", "content": PROBLEM["question"]}], "temperature": 0.0}


def calculator_model(hold: Any = None) -> DeterministicModel:
    return DeterministicModel(calculator_answers({PROBLEM["question"]: PROBLEM}), hold=hold)


def second_call(key: str | None, body: dict[str, Any]) -> bool:
    return bool(body["input"][-1].get("type") == "function_call_output")


@asynccontextmanager
async def started(
    implementation: str, root: Path, clock: FakeClock, *, enabled: bool = True, model: Any = None
) -> AsyncIterator[tuple[Stack, ParticipantUnderTest]]:
    placement = InProcess()
    config = checkpoint_config(root) if enabled else CheckpointConfig()
    async with (
        agent_stack(implementation, placement, config, clock, model=model) as stack,
        under_test(stack, placement, root, clock, TOKEN) as pt,
    ):
        yield stack, pt


async def invoke(
    pt: ParticipantUnderTest, key: str, activation: int | None, body: Any = None
) -> httpx.Response:
    headers = {} if activation is None else {"x-ng-agent-activation": str(activation)}
    return await pt.client.post(f"/ng-rollout/{key}/v1/responses", json=body or BODY, headers=headers)


async def until(condition: Callable[[], Any], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not await _value(condition()):
        assert time.monotonic() < deadline, f"never: {what}"
        await asyncio.sleep(0.001)


async def _value(value: Any) -> Any:
    return await value if asyncio.iscoroutine(value) else value


async def extras(pt: ParticipantUnderTest) -> dict[str, Any]:
    extras: dict[str, Any] = (await Control(pt).status())["extras"]
    return extras


def output_types(reply: httpx.Response) -> list[str]:
    return [item["type"] for item in reply.json()["output"]]


# ---- the conformance suite ---------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(CHECKS))
async def test_conformance_of_the_simple_agent(name: str, root: Path, clock: FakeClock) -> None:
    @asynccontextmanager
    async def make() -> AsyncIterator[ParticipantUnderTest]:
        async with started("simple_agent", root, clock) as (_, pt):
            yield pt

    await CHECKS[name](make)


async def test_conformance_of_the_restart_only_agent(root: Path, clock: FakeClock) -> None:
    @asynccontextmanager
    async def make() -> AsyncIterator[ParticipantUnderTest]:
        async with started("restart_only_agent", root, clock) as (_, pt):
            yield pt

    results = await check_participant(make, skip=RESTART_ONLY_SKIPS)
    expected = {name: "passed" for name in CHECKS if name not in RESTART_ONLY_SKIPS}
    never = "not applicable: a restart-only agent never blocks a prepare"
    expected["prepare_reports_blockers_until_ready"] = never
    assert results == expected


# ---- off ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("implementation", AGENTS)
async def test_off_mounts_nothing_and_deduplicates_nothing(
    implementation: str, root: Path, clock: FakeClock
) -> None:
    model = calculator_model()
    async with started(implementation, root, clock, enabled=False, model=model) as (_, pt):
        status = await pt.client.get("/ng-control/v1/checkpoint/status", headers=AUTH)
        assert status.status_code == 404
        assert (await invoke(pt, "r", 3)).status_code == 200
        again = await invoke(pt, "r", 3)
        assert again.status_code == 200 and "x-ng-checkpoint-close" not in again.headers  # replies as before
        assert len(model.calls) == 4  # ran twice
        assert (await pt.client.post("/v1/responses", json=BODY)).status_code == 200  # no identity needed


# ---- activations --------------------------------------------------------------------------------


async def test_a_completed_activation_answers_again_without_running(root: Path, clock: FakeClock) -> None:
    model = calculator_model()
    async with started("simple_agent", root, clock, model=model) as (_, pt):
        first = await invoke(pt, "r", 1)
        assert first.status_code == 200 and output_types(first) == ["function_call", "function_call_output",
                                                                    "message"]
        assert first.headers["x-ng-checkpoint-close"] == "replay"  # its /close may run again
        again = await invoke(pt, "r", 1)
        assert again.status_code == 200 and again.json() == first.json() and len(model.calls) == 2
        assert (await extras(pt))["tool_calls"] == 1
        for index, body in ((3, BODY), (1, {**BODY, "temperature": 0.5})):
            refused = await invoke(pt, "r", index, body)
            assert refused.status_code == 409 and refused.json()["error"]["code"] == "activation_out_of_order"
        assert (await invoke(pt, "r", 2)).status_code == 200 and len(model.calls) == 4
        older = await invoke(pt, "r", 1)
        assert older.json()["error"]["code"] == "activation_out_of_order"
        assert (await invoke(pt, "other", None)).status_code == 200  # unnumbered: the next one


async def test_an_activation_invoked_while_it_runs_is_joined(root: Path, clock: FakeClock) -> None:
    async with started("simple_agent", root, clock) as (stack, pt):
        first = asyncio.create_task(invoke(pt, "j", 1, {"input": "hold on"}))
        await stack.hooks.until_held("j")  # type: ignore[union-attr]
        second = asyncio.create_task(invoke(pt, "j", 1, {"input": "hold on"}))
        ahead = await invoke(pt, "j", 2, {"input": "hold on"})
        assert ahead.json()["error"]["code"] == "activation_out_of_order"
        await stack.helpers["resources"].post("/_test/release/j")
        replies = await asyncio.wait_for(asyncio.gather(first, second), WAIT_S)
        assert replies[0].json() == replies[1].json() and len(stack.server.calls) == 2


# ---- boundaries and parking -----------------------------------------------------------------------


async def test_a_session_awaiting_its_model_is_at_a_boundary(root: Path, clock: FakeClock) -> None:
    model = calculator_model(hold=second_call)
    async with started("simple_agent", root, clock, model=model) as (_, pt):
        control = Control(pt)
        run = asyncio.create_task(invoke(pt, "m", 1))
        await until(lambda: model.holding["m"] == 1, "the second model call is awaited")
        prepared = await control.ok("prepare", checkpoint_id="c1")
        assert prepared["report"]["ready"] is True and prepared["report"]["counts"]["awaiting_model"] == 1
        await control.ok("resume", checkpoint_id="c1")
        model.release()
        assert (await asyncio.wait_for(run, WAIT_S)).status_code == 200


async def test_a_tool_call_blocks_and_the_next_call_parks_until_resume(root: Path, clock: FakeClock) -> None:
    async with started("simple_agent", root, clock) as (stack, pt):
        control, model = Control(pt), stack.server
        run = asyncio.create_task(invoke(pt, "t", 1, {"input": "hold on"}))
        await stack.hooks.until_held("t")  # type: ignore[union-attr]
        prepare = asyncio.create_task(control.ok("prepare", checkpoint_id="c1"))
        await until(lambda: _reported(pt), "the prepare reported")
        assert (await control.status())["report"]["blockers"] == ["t"]
        await stack.helpers["resources"].post("/_test/release/t")
        assert (await asyncio.wait_for(prepare, WAIT_S))["report"]["ready"] is True
        counts = await extras(pt)
        assert counts["parked"] == 1 and counts["tool_calls"] == 1 and len(model.calls) == 1
        await control.ok("resume", checkpoint_id="c1")
        reply = await asyncio.wait_for(run, WAIT_S)
        assert reply.status_code == 200 and len(model.calls) == 2


async def _reported(pt: ParticipantUnderTest) -> bool:
    return (await Control(pt).status())["report"] is not None


# ---- the loop state, encoded where it stands still ----------------------------------------------


async def test_the_snapshot_is_evaluated_when_a_call_starts_and_a_commit_only_looks_it_up(
    root: Path, clock: FakeClock
) -> None:
    sessions = AgentSessions()
    participant = Participant(kind="agent", instance="a", adapter=sessions, store=CheckpointStore(root),
                              lease_grace_s=600.0, clock=clock)
    sessions.participant = participant
    evaluated: list[int] = []
    in_third_call, proceed = asyncio.Event(), asyncio.Event()

    async def work(turn: Turn) -> ActivationReply:
        state = {"calls": 0}
        turn.track(lambda: evaluated.append(state["calls"]) or dict(state))
        for _ in range(3):
            async with turn.call("model"):
                if state["calls"] == 2:
                    in_third_call.set()
                    await proceed.wait()
                state["calls"] += 1
        return ActivationReply({"output": []}, {})

    token = CURRENT_IDENTITY.set(RolloutIdentity("s"))
    try:
        run = asyncio.create_task(sessions.activate(1, {"input": "x"}, work))
        await asyncio.wait_for(in_third_call.wait(), WAIT_S)
        assert evaluated == [0, 1, 2]  # once per call, as it starts: on the data plane
        deadline = clock.now() + 30
        await participant.prepare(ControlRequest(checkpoint_id="c1", deadline_ts=deadline))
        directory = root / "ck"
        committed = await participant.commit(CommitRequest(checkpoint_id="c1", deadline_ts=deadline,
                                                           checkpoint_dir=str(directory)))
        assert evaluated == [0, 1, 2]  # the commit found the record of the call it waits in
        scope = frozenset({RolloutIdentity("s")})
        records = CheckpointStore(root).read(directory, "agent", "a", scope).records
        assert [r.data["session"]["running"]["state"] for r in records] == [{"calls": 2}]
        assert committed["episode_ids"] == ["s"]
        await participant.resume(ControlRequest(checkpoint_id="c1", deadline_ts=deadline))
        proceed.set()
        await asyncio.wait_for(run, WAIT_S)
        assert evaluated == [0, 1, 2]  # no checkpoint open, no call left: nothing more
    finally:
        CURRENT_IDENTITY.reset(token)
        await participant.aclose()


# ---- continuation after a restore ---------------------------------------------------------------


async def checkpoint_mid_activation(root: Path, clock: FakeClock) -> tuple[dict[str, Any], Path]:
    """The reply of an uninterrupted activation, and a checkpoint taken while another awaits its
    second model call."""
    async with started("simple_agent", root, clock, model=calculator_model()) as (_, pt):
        reference = (await invoke(pt, "ref", 1)).json()
    model = calculator_model(hold=second_call)
    async with started("simple_agent", root, clock, model=model) as (_, pt):
        control = Control(pt)
        run = asyncio.create_task(invoke(pt, "r", 1))
        await until(lambda: model.holding["r"] == 1, "the second model call is awaited")
        await control.ok("prepare", checkpoint_id="c1")
        await control.ok("commit", checkpoint_id="c1", checkpoint_dir=str(root / "ck"))
        model.release()  # held by the "policy model" until after the commit: never part of it
        run.cancel()  # the crash
    return reference, root / "ck"


async def restored(pt: ParticipantUnderTest, directory: Path, rollout_id: str = "r") -> None:
    control = Control(pt)
    reply = await control.ok("restore", checkpoint_id="back", checkpoint_dir=str(directory),
                             episode_ids=[{"rollout_id": rollout_id}])
    assert reply["restored"] == [f"{rollout_id}-a1"]
    await control.ok("resume", checkpoint_id="back")


async def test_a_restored_activation_continues_without_repeating_a_call(root: Path, clock: FakeClock) -> None:
    reference, directory = await checkpoint_mid_activation(root, clock)
    (instance,) = [path.name for path in (directory / "gym" / "agent").iterdir()]
    written = CheckpointStore(root).read(directory, "agent", instance, frozenset({RolloutIdentity("r")}))
    state = written.records[0].data["session"]["running"]["state"]
    assert state["turns"] == 1 and "input" not in state and "params" not in state  # the request's: not written
    fresh = calculator_model()
    async with started("simple_agent", root, clock, model=fresh) as (_, pt):
        await restored(pt, directory)
        assert (await extras(pt))["restored"] == 1
        ahead = await invoke(pt, "r-a1", 2)
        assert ahead.json()["error"]["code"] == "activation_out_of_order"
        other = await invoke(pt, "r-a1", 1, {**BODY, "temperature": 0.7})
        assert other.status_code == 422 and other.json()["error"]["code"] == "invalid_checkpoint_state"
        reply = await invoke(pt, "r-a1", 1)
        assert reply.status_code == 200, reply.text
        assert reply.json() == reference
        assert fresh.capture_keys() == ["r-a1"]  # only the call that was never delivered
        continued = fresh.calls[0].body  # its input and parameters came from the request sent again
        assert continued["input"][0] == BODY["input"][0] and continued["temperature"] == 0.0
        counts = await extras(pt)
        assert counts["tool_calls"] == 0 and counts["model_calls"] == 1
        assert (await invoke(pt, "r-a1", 1)).json() == reference and len(fresh.calls) == 1


async def test_a_restored_completed_activation_answers_its_reply(root: Path, clock: FakeClock) -> None:
    model = calculator_model()
    async with started("simple_agent", root, clock, model=model) as (_, pt):
        first = (await invoke(pt, "done", 1)).json()
        control = Control(pt)
        await control.ok("prepare", checkpoint_id="c1")
        await control.ok("commit", checkpoint_id="c1", checkpoint_dir=str(root / "ck"))
    fresh = calculator_model()
    async with started("simple_agent", root, clock, model=fresh) as (_, pt):
        await restored(pt, root / "ck", "done")
        assert (await invoke(pt, "done-a1", 1)).json() == first and fresh.calls == []
        assert (await invoke(pt, "done-a1", 2)).status_code == 200 and len(fresh.calls) == 2


# ---- restart-only -----------------------------------------------------------------------------------


async def test_restart_only_sessions_never_block_park_or_export(root: Path, clock: FakeClock) -> None:
    async with started("restart_only_agent", root, clock) as (stack, pt):
        control = Control(pt)
        run = asyncio.create_task(invoke(pt, "o", 1, {"input": "hold on"}))
        await stack.hooks.until_held("o")  # type: ignore[union-attr]
        prepared = await control.ok("prepare", checkpoint_id="c1")
        assert prepared["report"]["ready"] is True and prepared["report"]["restarts"] == ["o"]
        await stack.helpers["resources"].post("/_test/release/o")
        reply = await asyncio.wait_for(run, WAIT_S)  # kept running through the open checkpoint
        assert reply.status_code == 200 and reply.headers["x-ng-checkpoint-restart"] == "1"
        committed = await control.ok("commit", checkpoint_id="c1", checkpoint_dir=str(root / "ck"))
        assert committed["manifest"]["record_count"] == 0
        await control.ok("resume", checkpoint_id="c1")
        assert (await extras(pt))["checkpoint_sessions"] is False


async def test_a_restart_only_agent_refuses_records(root: Path, clock: FakeClock) -> None:
    directory = write_agent_checkpoint(root, "restart_only", [valid_record("r")])
    async with started("restart_only_agent", root, clock) as (_, pt):
        error = await Control(pt).refused("invalid_checkpoint_state", "restore", checkpoint_id="x",
                                          checkpoint_dir=str(directory), episode_ids=[{"rollout_id": "r"}])
        assert "restart-only" in error["detail"]


# ---- retire, close ---------------------------------------------------------------------------------


async def test_retire_stops_a_running_activation_and_frees_the_session(root: Path, clock: FakeClock) -> None:
    async with started("simple_agent", root, clock) as (stack, pt):
        control = Control(pt)
        run = asyncio.create_task(invoke(pt, "x", 1, {"input": "hold on"}))
        await stack.hooks.until_held("x")  # type: ignore[union-attr]
        await control.ok("retire", checkpoint_id="h1", episode_ids=[{"rollout_id": "x"}])
        reply = await asyncio.wait_for(run, WAIT_S)
        assert reply.status_code == 409 and reply.json()["error"]["code"] == "stale_attempt"
        counts = await extras(pt)
        assert (counts["sessions"], counts["running"], counts["in_tool_call"]) == (0, 0, 0)
        await control.ok("forget", checkpoint_id="h2", rollout_ids=["x"])
        assert (await control.status())["retired_rollouts"] == 0


async def test_close_stops_a_running_activation(root: Path, clock: FakeClock) -> None:
    async with started("simple_agent", root, clock) as (stack, pt):
        run = asyncio.create_task(invoke(pt, "c", 1, {"input": "hold on"}))
        await stack.hooks.until_held("c")  # type: ignore[union-attr]
        assert (await pt.client.post("/ng-rollout/c/close")).json() == {"closed": True}
        assert (await asyncio.wait_for(run, WAIT_S)).json()["error"]["code"] == "stale_attempt"
        assert (await pt.client.post("/ng-rollout/c/close")).json() == {"closed": False}
        assert (await extras(pt))["sessions"] == 0


# ---- malformed records --------------------------------------------------------------------------------


def valid_record(rollout_id: str, **session: Any) -> dict[str, Any]:
    return {"episode_id": {"rollout_id": rollout_id, "attempt": 0},
            "session": {"completed": 0, "completed_digest": None, "reply": None, "running": None, **session}}


def write_agent_checkpoint(root: Path, label: str, records: list[dict[str, Any]]) -> Path:
    directory = root / label
    writer = CheckpointStore(root).open_writer(directory, "agent", "agent", StopSignal())
    writer.write_lines([orjson.dumps(record) for record in records])
    writer.finish("agent", "agent", label)
    return directory


DIGEST = "0" * 64
LOOP = {"input": [], "params": {}, "max_steps": 4, "outputs": [], "usage": None, "turns": 0, "pending": [],
        "cookies": {}, "model_cookies": {}, "last_response": None, "stop_reason": None, "model_calls": []}
SNAPSHOT = {**{k: v for k, v in LOOP.items() if k not in ("input", "params")}, "echoed": []}


@pytest.mark.parametrize(
    ("session", "detail"),
    [
        ({"completed": 1}, "all set or all empty"),
        ({"completed": -1}, "completed must be"),
        ({"completed": 1, "completed_digest": DIGEST, "reply": {"response": {}}}, "reply is"),
        ({"running": {"index": 2, "request_digest": DIGEST, "state": None}}, "expected 1"),
        ({"running": {"index": 1, "request_digest": "x", "state": None}}, "request_digest"),
        ({"running": {"index": 1, "request_digest": DIGEST, "state": {**LOOP, "turns": "1"}}}, "turns"),
        ({"running": {"index": 1, "request_digest": DIGEST, "state": {"x": 1}}}, "fields"),
        ({"running": {"index": 1, "request_digest": DIGEST,
                      "state": {**SNAPSHOT, "last_response": {"tools": []}, "echoed": ["tools"]}}}, "echoes"),
        ({"extra": 1}, "fields"),
    ],
)
async def test_a_malformed_session_record_is_refused_and_nothing_installed(
    session: dict[str, Any], detail: str, root: Path, clock: FakeClock
) -> None:
    good = valid_record("ok", running={"index": 1, "request_digest": DIGEST, "state": SNAPSHOT})
    directory = write_agent_checkpoint(root, "bad", [good, valid_record("r", **session)])
    async with started("simple_agent", root, clock) as (_, pt):
        error = await Control(pt).refused("invalid_checkpoint_state", "restore", checkpoint_id="x",
                                          checkpoint_dir=str(directory),
                                          episode_ids=[{"rollout_id": "ok"}, {"rollout_id": "r"}])
        assert detail in error["detail"]
        assert (await extras(pt))["sessions"] == 0


# ---- token arrays ---------------------------------------------------------------------------------


TOKEN_FIELDS = ("prompt_token_ids", "generation_token_ids", "generation_log_probs")


async def test_records_carry_no_token_arrays_and_restored_turns_continue_without_them(
    root: Path, clock: FakeClock
) -> None:
    model = calculator_model(hold=second_call)
    placement = InProcess()
    config = checkpoint_config(root)
    async with (
        agent_stack("simple_agent", placement, config, clock, model=model, return_token_ids=True) as stack,
        under_test(stack, placement, root, clock, TOKEN) as pt,
    ):
        control = Control(pt)
        run = asyncio.create_task(invoke(pt, "tok", 1))
        await until(lambda: model.holding["tok"] == 1, "the second model call is awaited")
        await control.ok("prepare", checkpoint_id="c1")
        committed = await control.ok("commit", checkpoint_id="c1", checkpoint_dir=str(root / "ck"))
        where = root / "ck" / "gym" / "agent" / "agent" / committed["manifest"]["records_file"]
        text = where.read_text()
        assert "function_call" in text and not any(field in text for field in TOKEN_FIELDS)
        await control.ok("resume", checkpoint_id="c1")
        model.release()
        kept = (await asyncio.wait_for(run, WAIT_S)).json()["output"]
        assert all(field in kept[0] for field in TOKEN_FIELDS)  # no crash: nothing was lost
    fresh = calculator_model()
    async with (
        agent_stack("simple_agent", placement, config, clock, model=fresh, return_token_ids=True) as stack,
        under_test(stack, placement, root, clock, TOKEN) as pt,
    ):
        await restored(pt, root / "ck", "tok")
        output = (await invoke(pt, "tok-a1", 1)).json()["output"]
        assert [item["type"] for item in output] == ["function_call", "function_call_output", "message"]
        assert not any(field in output[0] for field in TOKEN_FIELDS)  # made before the checkpoint
        assert all(field in output[2] for field in TOKEN_FIELDS)  # made after the restore
        assert output[0] == {k: v for k, v in kept[0].items() if k not in TOKEN_FIELDS}
