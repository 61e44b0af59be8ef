"""Issue 6 item 3 on real processes: crashes at awkward moments, resources state, verify modes, 64 at once.

One mesh for the module: ``configs/quickstart.yaml`` (inference worker on the embedded default
model, greedy; policy model; calculator_tools; simple_agent; single_agent_turn) plus the kv_store
environment of ``tests/fixtures/kv_turn.yaml`` (kv_agent, kv_turn over kv_store: an ``exported``
resources server with a ``wait`` verify), checkpointing on, each server its own process. The test
is the controller: it dispatches ``/ng-rollout/<key>/run``, drives a ``Coordinator``, pauses
servers with SIGSTOP to hold rollouts at a chosen point (``tests/support/crash_scenarios.py``), and
crashes the mesh with SIGKILL of every server and fresh processes on the same ports.

- a second crash after the restore, before the continued attempts run: restoring the same
  checkpoint again installs the same attempts N+1; they finish once each, the directory unchanged;
- a crash after the continued attempts made model and tool calls: the same (older) checkpoint again;
- a verify in flight that ends while the prepare waits for it: checkpointed at the boundary after it;
- 64 rollouts checkpointed in flight, crash, restore: all finish once with the reference rows;
- kv_store session state across a crash, with a negative control left out of the restore;
- a replay verify in flight does not hold a checkpoint; a wait verify does.

Each test first runs its rows uninterrupted (under other rollout ids) with the model calls batched
as in the checkpointed run: all first calls reach the worker as one batch, then all second calls
(the worker's batches decide the last bits of the log probabilities). Rows are compared with
``assert_continued`` of ``test_checkpoint_mesh`` (equal, token arrays included, log probabilities
to the collector's tolerance). Every test checks
that each rollout finished once, the model's capture ledger and the agents' tool-call counts (no
call made twice), and ends with the mesh idle: after forget, no participant holds anything.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import pytest

from nemo_gym_ckpt.checkpoint.coordinator import RestoreResult
from nemo_gym_ckpt.client import MeshClient
from nemo_gym_ckpt.config import load_config
from nemo_gym_ckpt.errors import InvalidRequest
from nemo_gym_ckpt.identity import RolloutIdentity
from nemo_gym_ckpt.launch.launcher import MeshLauncher
from tests.conftest import FIXTURES
from tests.e2e.test_checkpoint_mesh import assert_continued, model_calls, tool_calls
from tests.support.crash_scenarios import (
    MODEL,
    WAIT_S,
    WORKER,
    CrashMesh,
    holding,
    mesh_overrides,
    records_of,
    snapshot,
    until,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
ENV, AGENT, RESOURCES = "single_agent_turn", "simple_agent", "calculator_tools"
KV_ENV, KV_AGENT, KV = "kv_turn", "kv_agent", "kv_store"
CALCULATOR_ROWS = 64
KV_PROMPTS = ("Say hello.", "Name a colour.")


@dataclass
class Started:
    launcher: MeshLauncher
    root: Path


def calculator_rows() -> list[dict[str, Any]]:
    lines = (ROOT / "resources_servers/calculator_tools/data/quickstart.jsonl").read_bytes().splitlines()
    return [orjson.loads(line) for line in lines[:CALCULATOR_ROWS]]


ROWS = {
    "calculator": calculator_rows(),
    # rows the default model answers in one call, without tools: the kv store stays empty
    "kv": [{"responses_create_params": {"input": [{"role": "user", "content": prompt}]}, "expected_state": {}}
           for prompt in KV_PROMPTS],
}


@pytest.fixture(scope="module")
def started(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Started]:
    root = tmp_path_factory.mktemp("checkpoints")
    config = load_config([ROOT / "configs/quickstart.yaml", FIXTURES / "kv_turn.yaml"], mesh_overrides(root))
    launcher = MeshLauncher(config)
    launcher.start(ready_timeout_s=180)
    try:
        yield Started(launcher, root)
    finally:
        pids = list(launcher.pids.values())
        launcher.stop()
    assert not [pid for pid in pids if _alive(pid)], "a server process outlived the stop"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture
async def mesh(started: Started) -> AsyncIterator[CrashMesh]:
    """The module's mesh; afterwards nothing stays paused, and a mesh left holding anything is replaced."""
    async with MeshClient() as client:
        crash = CrashMesh(started.launcher, started.root, client)
        await crash.discover()
        try:
            yield crash
        finally:
            await crash.cancel_all()
            crash.proceed_all()
            async with crash.coordinator() as coordinator:
                statuses = await coordinator.status()
            if holding(statuses):  # a failed test: the next one gets fresh processes
                await crash.crash()


# ---- the controller's steps --------------------------------------------------------------------


async def checkpoint(
    mesh: CrashMesh, checkpoint_id: str, tasks: Mapping[RolloutIdentity, asyncio.Task[Any]]
) -> tuple[Path, list[RolloutIdentity]]:
    """Prepare, commit every rollout in flight, resume; the directory and the scope."""
    directory = mesh.root / checkpoint_id
    async with mesh.coordinator() as coordinator:
        deadline = time.time() + WAIT_S
        prepared = await coordinator.prepare(checkpoint_id, deadline_ts=deadline)
        assert prepared.prepared, prepared.to_json()
        scope = prepared.continued([identity for identity, task in tasks.items() if not task.done()])
        committed = await coordinator.commit(checkpoint_id, deadline_ts=deadline, checkpoint_dir=str(directory),
                                             episode_ids=scope)
        await coordinator.resume(checkpoint_id, deadline_ts=deadline)
    assert sorted(committed.episode_ids()) == sorted(e.capture_key for e in scope)
    return directory, scope


async def restore(
    mesh: CrashMesh, restore_id: str, directory: Path, scope: Sequence[RolloutIdentity], *, resume: bool = True
) -> RestoreResult:
    """Restore on fresh processes, fence the checkpointed attempts by retire, resume (controller.md 5)."""
    async with mesh.coordinator() as coordinator:
        deadline = time.time() + WAIT_S
        restored = await coordinator.restore(restore_id, deadline_ts=deadline, checkpoint_dir=str(directory),
                                             episode_ids=scope)
        await coordinator.retire(list(scope), deadline_ts=deadline, checkpoint_id=restore_id)
        if resume:
            await coordinator.resume(restore_id, deadline_ts=deadline)
    return restored


async def lost(tasks: Mapping[RolloutIdentity, asyncio.Task[Any]]) -> None:
    """Every ``/run`` sent to the killed processes failed: none of them finished."""
    outcomes = await asyncio.gather(*tasks.values(), return_exceptions=True)
    assert not [o for o in outcomes if not isinstance(o, BaseException) and o.status_code == 200]


async def replies_of(tasks: Mapping[RolloutIdentity, asyncio.Task[Any]]) -> dict[RolloutIdentity, dict[str, Any]]:
    """The rows of the ``/run`` calls, each of which must succeed."""
    replies = dict(zip(tasks, await asyncio.gather(*tasks.values()), strict=True))
    codes = {identity.capture_key: reply.status_code for identity, reply in replies.items()}
    assert codes == dict.fromkeys(codes, 200), codes
    return {identity: reply.json() for identity, reply in replies.items()}


async def batched(
    mesh: CrashMesh, env: str, rows: Mapping[RolloutIdentity, dict[str, Any]], gate_id: str | None = None
) -> dict[RolloutIdentity, dict[str, Any]]:
    """Run ``rows`` to their end with each one's next model call reaching the worker in one batch,
    and (``gate_id``) the call after it in a second batch: the worker's batches decide the last bits
    of the log probabilities, so a reference is batched as the run it is compared with."""
    tasks = await mesh.admit_calls(env, rows)
    if gate_id is not None:
        await mesh.deliver_one_call(AGENT if env == ENV else KV_AGENT, gate_id)
    mesh.proceed(WORKER)
    return await replies_of(tasks)


async def reference(
    mesh: CrashMesh, env: str, rows: Mapping[RolloutIdentity, dict[str, Any]], gate_id: str | None = None
) -> dict[str, dict[str, Any]]:
    """The uninterrupted rows (batched as ``batched`` does) by the rollout id they are references of."""
    done = await batched(mesh, env, references_for(rows), gate_id)
    await mesh.assert_idle([identity.rollout_id for identity in done])
    return by_origin(done)


def references_for(rows: Mapping[RolloutIdentity, dict[str, Any]]) -> dict[RolloutIdentity, dict[str, Any]]:
    """The same rows under the rollout ids of their reference runs."""
    return {RolloutIdentity(f"{identity.rollout_id}-ref"): row for identity, row in rows.items()}


def by_origin(done: Mapping[RolloutIdentity, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Reference rows by the rollout id they are the references of."""
    return {identity.rollout_id.removesuffix("-ref"): row for identity, row in done.items()}


def assert_reference_rows(
    rows: Mapping[RolloutIdentity, dict[str, Any]], expected: Mapping[str, dict[str, Any]]
) -> None:
    """Each rollout finished once, its row the uninterrupted run's, token arrays included."""
    assert sorted(identity.rollout_id for identity in rows) == sorted(expected), "each rollout exactly once"
    for identity, row in rows.items():
        reference = expected[identity.rollout_id]
        assert_continued(row, reference)


def of(kind: str, prefix: str, indices: Sequence[int]) -> dict[RolloutIdentity, dict[str, Any]]:
    return {RolloutIdentity(f"{prefix}{i}"): ROWS[kind][i] for i in indices}


def next_rows(
    rows: Mapping[RolloutIdentity, dict[str, Any]], continued: Sequence[RolloutIdentity]
) -> dict[RolloutIdentity, dict[str, Any]]:
    """The task row of each continued attempt (the same row as its checkpointed attempt)."""
    by_rollout = {identity.rollout_id: row for identity, row in rows.items()}
    return {identity: by_rollout[identity.rollout_id] for identity in continued}


# ---- a, b: crash again after the restore -------------------------------------------------------


async def test_a_second_crash_before_the_continued_attempts_run_restores_the_same_attempts_again(
    mesh: CrashMesh,
) -> None:
    rows = of("calculator", "a", range(4))
    expected = await reference(mesh, ENV, rows, "a-reference-gate")
    tasks = await mesh.admit_calls(ENV, rows)
    await mesh.deliver_one_call(AGENT, "a-gate")  # each: a model call and a tool call, the next call in flight
    directory, scope = await checkpoint(mesh, "a", tasks)
    assert len(scope) == len(rows)
    kept = snapshot(directory)
    await mesh.crash()
    await lost(tasks)

    first = await restore(mesh, "a-restore-1", directory, scope, resume=False)
    assert first.continued() == [e.next_attempt() for e in scope] and first.restarts() == []
    assert (await mesh.extras(MODEL))["rows"] == len(scope)  # each rollout's delivered call came back
    await mesh.crash()  # restored, not resumed, nothing dispatched: a second crash
    assert snapshot(directory) == kept

    second = await restore(mesh, "a-restore-2", directory, scope)
    assert second.continued() == first.continued()  # the same attempts N+1 again, from the same directory
    finished = await batched(mesh, ENV, next_rows(rows, second.continued()))
    counts = await mesh.counts([MODEL, AGENT])

    assert_reference_rows(finished, expected)
    calls = sum(model_calls(row) for row in expected.values())
    assert counts[MODEL]["rows"] == calls  # none made twice
    assert counts[AGENT]["tool_calls"] == 0  # every tool call was made before the checkpoint, once
    assert snapshot(directory) == kept
    await mesh.assert_idle([e.rollout_id for e in scope])


async def test_b_a_crash_after_the_continued_attempts_made_calls_restores_the_older_checkpoint_again(
    mesh: CrashMesh,
) -> None:
    rows = of("calculator", "b", range(4, 8))
    expected = await reference(mesh, ENV, rows, "b-reference-gate")
    tasks = await mesh.admit_calls(ENV, rows)  # each seeded, its first model call in flight
    directory, scope = await checkpoint(mesh, "b", tasks)
    kept = snapshot(directory)
    await mesh.crash()
    await lost(tasks)

    first = await restore(mesh, "b-restore-1", directory, scope)
    assert first.continued() == [e.next_attempt() for e in scope]
    replacement = await mesh.admit_calls(ENV, next_rows(rows, first.continued()))
    await mesh.deliver_one_call(AGENT, "b-gate")  # the attempts N+1 made a model call and a tool call each
    made = await mesh.counts([MODEL, AGENT])
    assert (made[MODEL]["rows"], made[AGENT]["tool_calls"]) == (len(scope), len(scope))
    await mesh.crash()
    await lost(replacement)
    assert snapshot(directory) == kept

    second = await restore(mesh, "b-restore-2", directory, scope)
    assert second.continued() == first.continued()
    finished = await batched(mesh, ENV, next_rows(rows, second.continued()), "b-final-gate")
    counts = await mesh.counts([MODEL, AGENT])

    assert_reference_rows(finished, expected)
    calls, tools = (sum(count(row) for row in expected.values()) for count in (model_calls, tool_calls))
    assert (counts[MODEL]["rows"], counts[AGENT]["tool_calls"]) == (calls, tools)
    assert snapshot(directory) == kept  # the directory restored from, twice, is byte for byte the same
    await mesh.assert_idle([e.rollout_id for e in scope])


# ---- c: an episode's last verify ends while the prepare waits ------------------------------------


async def verifying(mesh: CrashMesh, env: str, agent: str, count: int) -> None:
    """Wait until ``count`` episodes of ``env`` are in a step after closing the agent: the verify."""

    def there(now: dict[str, dict[str, Any]]) -> bool:
        episodes = now[env]
        in_step = episodes["in_wait_step"] + episodes["in_replay_step"]
        return episodes["episodes"] == in_step == count and now[agent]["sessions"] == 0

    await until(lambda: mesh.counts([env, agent]), there, f"{count} episodes of {env} verifying")


async def prepare_reported(mesh: CrashMesh, name: str, checkpoint_id: str) -> dict[str, Any]:
    """The status of ``name`` once its prepare for ``checkpoint_id`` is ready, or waits on blockers."""

    def reported(status: dict[str, Any]) -> bool:
        report, phase = status["report"], status["phase"]
        return status["checkpoint_id"] == checkpoint_id and (
            phase == "prepared" or (phase == "preparing" and report is not None and bool(report["blockers"])))

    return await until(lambda: mesh.status(name), reported, f"{name}'s prepare of {checkpoint_id} reporting")


async def test_c_a_verify_that_ends_while_the_prepare_waits_is_checkpointed_after_it(mesh: CrashMesh) -> None:
    rows = of("kv", "c", range(len(KV_PROMPTS)))
    expected = await reference(mesh, KV_ENV, rows)
    tasks = await mesh.admit_calls(KV_ENV, rows)  # one model call each: the answer
    mesh.pause(KV)
    mesh.proceed(WORKER)
    await verifying(mesh, KV_ENV, KV_AGENT, len(rows))  # each verify waits at the paused kv_store
    keys = sorted(identity.capture_key for identity in rows)
    async with mesh.coordinator() as coordinator:
        deadline = time.time() + WAIT_S
        preparing = mesh.start(coordinator.prepare("c", deadline_ts=deadline))
        waiting = await prepare_reported(mesh, KV_ENV, "c")
        assert (waiting["phase"], waiting["report"]["ready"], sorted(waiting["report"]["blockers"])) == (
            "preparing", False, keys)  # kv_store's verify is a wait step: the prepare waits for both
        assert not preparing.done()
        mesh.proceed(KV)  # the verifies end while the prepare waits; the episodes park after them
        prepared = await asyncio.wait_for(preparing, WAIT_S)
        assert prepared.prepared, prepared.to_json()
        assert not any(task.done() for task in tasks.values())  # finished episodes' replies wait too
        scope = prepared.continued(list(tasks))
        await coordinator.commit("c", deadline_ts=deadline, checkpoint_dir=str(mesh.root / "c"), episode_ids=scope)
    # the crash comes right after the commit, before the resume: resumed, these episodes would finish
    records = records_of(mesh.root / "c", "environment", KV_ENV)
    assert sorted(records) == keys
    for record in records.values():  # after the verify: it is never made again
        assert record["boundary"]["next_step"] == "close_session"
        assert record["boundary"]["state"]["verdict"]["reward"] == 1.0
    await mesh.crash()
    await lost(tasks)

    restored = await restore(mesh, "c-restore", mesh.root / "c", scope)
    finished = await replies_of(mesh.dispatch(KV_ENV, next_rows(rows, restored.continued())))
    counts = await mesh.counts([MODEL, KV_AGENT])
    assert_reference_rows(finished, expected)
    assert counts[MODEL]["rows"] == len(rows)  # the restored ledger rows; no model call made again
    assert counts[KV_AGENT]["model_calls"] == 0
    await mesh.assert_idle([e.rollout_id for e in scope])


# ---- d: 64 rollouts --------------------------------------------------------------------------------


@pytest.mark.timeout(360)
async def test_d_64_concurrent_rollouts_checkpointed_in_flight_continue_after_a_crash_exactly_once(
    mesh: CrashMesh,
) -> None:
    rows = of("calculator", "d", range(CALCULATOR_ROWS))
    expected = await reference(mesh, ENV, rows, "d-reference-gate")
    tasks = await mesh.admit_calls(ENV, rows)
    await mesh.deliver_one_call(AGENT, "d-gate")
    directory, scope = await checkpoint(mesh, "d", tasks)
    assert len(scope) == CALCULATOR_ROWS
    await mesh.crash()
    await lost(tasks)

    restored = await restore(mesh, "d-restore", directory, scope)
    assert restored.continued() == [e.next_attempt() for e in scope]
    finished = await batched(mesh, ENV, next_rows(rows, restored.continued()))
    counts = await mesh.counts([MODEL, AGENT])

    assert_reference_rows(finished, expected)
    calls = sum(model_calls(row) for row in expected.values())
    assert (counts[MODEL]["rows"], counts[MODEL]["ledgers"]) == (calls, CALCULATOR_ROWS)
    assert counts[AGENT]["tool_calls"] == 0
    await mesh.assert_idle([e.rollout_id for e in scope])


# ---- e: resources state ------------------------------------------------------------------------------


FIRST = (("kv_set", {"key": "colour", "value": "blue"}), ("kv_set", {"key": "size", "value": "9"}))
THEN = (("kv_delete", {"key": "colour"}), ("kv_set", {"key": "shape", "value": "round"}))
FINAL = {"size": "9", "shape": "round"}


class KvSession:
    """One kv_store session, driven by the test as an agent would: tool calls under its capture key."""

    def __init__(self, mesh: CrashMesh, identity: RolloutIdentity) -> None:
        self.mesh, self.identity = mesh, identity
        self.url = mesh.launcher.url_of(KV)
        self.cookies: dict[str, str] = {}

    async def seed(self) -> None:
        reply = await self.mesh.client.request("POST", f"{self.url}/seed_session", json={}, identity=self.identity)
        self.cookies = dict(reply.cookies)

    async def call(self, calls: Sequence[tuple[str, dict[str, Any]]]) -> None:
        for tool, args in calls:
            await self.mesh.client.post_json(f"{self.url}/{tool}", args, cookies=self.cookies,
                                             identity=self.identity)

    def next_attempt(self) -> KvSession:
        following = KvSession(self.mesh, self.identity.next_attempt())
        following.cookies = self.cookies
        return following

    async def verify(self) -> dict[str, Any]:
        answer = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "done"}]}
        row = {"expected_state": FINAL, "response": {"output": [answer]}}
        verdict: dict[str, Any] = await self.mesh.client.post_json(f"{self.url}/verify", row, cookies=self.cookies,
                                                                   identity=self.identity)
        return verdict


async def test_e_kv_store_session_state_survives_a_crash_and_is_lost_without_the_restore(mesh: CrashMesh) -> None:
    kept, dropped = KvSession(mesh, RolloutIdentity("e-kept")), KvSession(mesh, RolloutIdentity("e-dropped"))
    for session in (kept, dropped):
        await session.seed()
        await session.call(FIRST)
    async with mesh.coordinator() as coordinator:
        deadline = time.time() + WAIT_S
        prepared = await coordinator.prepare("e", deadline_ts=deadline)
        assert prepared.prepared, prepared.to_json()
        scope = [kept.identity, dropped.identity]
        await coordinator.commit("e", deadline_ts=deadline, checkpoint_dir=str(mesh.root / "e"), episode_ids=scope)
        await coordinator.resume("e", deadline_ts=deadline)
    states = {key: record["state"] for key, record in records_of(mesh.root / "e", "resources", KV).items()}
    assert states == {"e-kept": {"items": {"colour": "blue", "size": "9"}},
                      "e-dropped": {"items": {"colour": "blue", "size": "9"}}}
    await mesh.crash()

    restored = await restore(mesh, "e-restore", mesh.root / "e", [kept.identity])  # e-dropped left out
    assert restored.replies()[KV]["restored"] == ["e-kept-a1"]
    async with mesh.coordinator() as coordinator:  # fence the attempt that does not continue
        await coordinator.retire([dropped.identity], deadline_ts=time.time() + WAIT_S)
    continued, again = kept.next_attempt(), dropped.next_attempt()
    await continued.call(THEN)
    with pytest.raises(InvalidRequest, match="unknown session"):
        await again.call(THEN)  # without the restore its session is gone
    await again.seed()
    await again.call(THEN)
    uninterrupted = KvSession(mesh, RolloutIdentity("e-reference"))
    await uninterrupted.seed()
    await uninterrupted.call(FIRST + THEN)

    async with mesh.coordinator() as coordinator:
        deadline = time.time() + WAIT_S
        prepared = await coordinator.prepare("e-after", deadline_ts=deadline)
        assert prepared.prepared, prepared.to_json()
        scope = [continued.identity, again.identity, uninterrupted.identity]
        await coordinator.commit("e-after", deadline_ts=deadline, checkpoint_dir=str(mesh.root / "e-after"),
                                 episode_ids=scope)
        await coordinator.resume("e-after", deadline_ts=deadline)
    exported = {key: record["state"] for key, record in records_of(mesh.root / "e-after", "resources", KV).items()}
    assert exported["e-reference"] == {"items": FINAL}
    assert exported["e-kept-a1"] == exported["e-reference"]  # restored state, then the same calls
    assert exported["e-dropped-a1"] == {"items": {"shape": "round"}} != exported["e-reference"]
    verdicts = [await session.verify() for session in (continued, again, uninterrupted)]
    assert [verdict["reward"] for verdict in verdicts] == [1.0, 0.0, 1.0]
    await mesh.assert_idle(["e-kept", "e-dropped", "e-reference"])


# ---- f: replay against wait ----------------------------------------------------------------------------


async def verify_modes_run(
    mesh: CrashMesh, replay: Mapping[RolloutIdentity, dict[str, Any]], wait: Mapping[RolloutIdentity, dict[str, Any]],
    gate_id: str,
) -> dict[RolloutIdentity, asyncio.Task[Any]]:
    """The replay row awaiting its last model call, the wait row its only one, both admitted at the
    paused worker (as one batch when it goes on)."""
    tasks = await mesh.admit_calls(ENV, replay)
    await mesh.deliver_one_call(AGENT, gate_id)  # its tool call made: its next resources call is the verify
    return tasks | await mesh.admit_calls(KV_ENV, wait)


async def test_f_a_replay_verify_in_flight_does_not_hold_a_checkpoint_and_a_wait_verify_does(
    mesh: CrashMesh,
) -> None:
    replay_rows, wait_rows = of("calculator", "f-replay-", [8]), of("kv", "f-wait-", [0])
    references = await verify_modes_run(mesh, references_for(replay_rows), references_for(wait_rows),
                                        "f-reference-gate")
    mesh.proceed(WORKER)
    expected = by_origin(await replies_of(references))
    await mesh.assert_idle([identity.rollout_id for identity in references])

    tasks = await verify_modes_run(mesh, replay_rows, wait_rows, "f-gate")
    mesh.pause(RESOURCES, KV)
    mesh.proceed(WORKER)
    await verifying(mesh, ENV, AGENT, 1)  # calculator_tools declares checkpoint_verify = "replay"
    await verifying(mesh, KV_ENV, KV_AGENT, 1)  # kv_store declares "wait"
    async with mesh.coordinator() as coordinator:
        deadline = time.time() + WAIT_S
        preparing = mesh.start(coordinator.prepare("f", deadline_ts=deadline))

        replay, wait = await asyncio.gather(prepare_reported(mesh, ENV, "f"), prepare_reported(mesh, KV_ENV, "f"))
        # the replay verify cannot have answered (its server is paused), yet it holds nothing up
        assert (replay["phase"], replay["report"]["ready"], replay["report"]["blockers"]) == ("prepared", True, [])
        assert replay["report"]["counts"]["in_replay_step"] == 1
        # the wait verify holds the checkpoint
        assert (wait["phase"], wait["report"]["ready"], wait["report"]["blockers"]) == (
            "preparing", False, ["f-wait-0"])
        assert not preparing.done()
        mesh.proceed(KV)
        await until(lambda: mesh.status(KV_ENV), lambda s: s["phase"] == "prepared", "kv_turn prepared")
        mesh.proceed(RESOURCES)
        prepared = await asyncio.wait_for(preparing, WAIT_S)
        assert prepared.prepared, prepared.to_json()
        scope = prepared.continued(list(tasks))
        await coordinator.commit("f", deadline_ts=deadline, checkpoint_dir=str(mesh.root / "f"), episode_ids=scope)
        await coordinator.resume("f", deadline_ts=deadline)
    waited = records_of(mesh.root / "f", "environment", KV_ENV)["f-wait-0"]["boundary"]
    assert waited["next_step"] == "close_session"  # the checkpoint waited for the verify to end
    replayed = records_of(mesh.root / "f", "environment", ENV)["f-replay-8"]["boundary"]
    # before the verify (it is replayed after a crash), or after it if it ended before the commit
    assert replayed["next_step"] in ("verify", "close_session")
    assert ("verdict" in replayed["state"]) == (replayed["next_step"] == "close_session")
    assert_reference_rows(await replies_of(tasks), expected)
    await mesh.assert_idle(list(expected))
