"""Issue 5 acceptance on real processes: the quickstart mesh checkpointed while rollouts run.

The mesh of ``configs/quickstart.yaml`` (inference worker on the embedded default model, policy
model, calculator_tools, simple_agent, single_agent_turn; greedy decoding) with checkpointing on,
each server its own process, launched once for the module. A controller here dispatches rollouts
(``POST /ng-rollout/<key>/run``) and drives the ``Coordinator`` through the head server:

1. a checkpoint while 32 rollouts are mid-episode (each agent session past its first model call and
   in its tool call, held there by SIGSTOP of the resources server until the agent is preparing),
   no crash: every row equals the uninterrupted run's;
2. the same, then SIGKILL of every server and fresh processes on the same ports: restore, resume,
   dispatch the continued rollouts as attempt 1 (restarts afresh: there are none here). Every
   rollout finishes exactly once, no completed model call (the policy model's capture ledger) and
   no completed tool call (the agent's count of the calls it made on the resources server) is
   made again, and the rows equal the uninterrupted run's, token arrays included: records never
   carry them (docs/protocol.md section 6), the policy model keeps those of delivered calls in its token
   sidecar and the agent puts them back on its restored output items;
3. retire during a run, then forget: every rollout held in its tool call (SIGSTOP of the resources
   server) until the environment has the retire, so each ``/run`` answers 409 ``stale_attempt``;
   after the forget nothing is left on any participant;
4. a checkpoint that lands after the agent was done (each episode in or past its verify, the agent
   sessions closed, so only the environment's boundary holds the agent's reply, and its record has
   no token arrays), crash, restore: the rows equal the uninterrupted run's, token arrays included
   (the environment has the agent put them back from the policy model), no call made again. Signals
   hold the mesh still: SIGSTOP of the inference worker holds every model call admitted, SIGSTOP of
   the resources server holds every verify in flight, SIGCONT lets them go.

Rows are compared without the response's ``created_at`` (wall-clock seconds) and with log
probabilities equal to ``LOGPROB_TOLERANCE`` (1e-4, the collector's): the worker batches whatever
calls are in flight and reuses cached prompt prefixes, so two uninterrupted runs already differ in
the last bits of their log probabilities (up to ~5e-6 seen for the same batch twice).
"""

from __future__ import annotations

import asyncio
import math
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import pytest

from nemo_gym_ckpt.checkpoint.coordinator import Coordinator, PrepareResult
from nemo_gym_ckpt.client import MeshClient
from nemo_gym_ckpt.collect.rows import LOGPROB_TOLERANCE
from nemo_gym_ckpt.config import load_config
from nemo_gym_ckpt.errors import GymError
from nemo_gym_ckpt.identity import RolloutIdentity
from nemo_gym_ckpt.launch.launcher import MeshLauncher

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "issue-5-e2e-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}
ROLLOUTS = 32
RUN_TIMEOUT_S = 120.0
WAIT_S = 60.0
TOKEN_FIELDS = ("prompt_token_ids", "generation_token_ids", "generation_log_probs")
ENV, AGENT, MODEL, RESOURCES = "single_agent_turn", "simple_agent", "policy_model", "calculator_tools"
WORKER = "inference_worker"


@dataclass
class Mesh:
    launcher: MeshLauncher
    root: Path
    rows: list[dict[str, Any]]
    reference: list[dict[str, Any]]

    def env_url(self) -> str:
        return self.launcher.url_of(ENV)


def overrides(root: Path) -> list[str]:
    return ["head_server.port=0", "checkpoint.enabled=true", f"checkpoint.control_auth_token={TOKEN}",
            f"checkpoint.root={root}", "policy_model.responses_api_models.policy_model.checkpoint_policy=true"]


def task_rows() -> list[dict[str, Any]]:
    lines = (ROOT / "resources_servers/calculator_tools/data/quickstart.jsonl").read_bytes().splitlines()
    return [orjson.loads(line) for line in lines[:ROLLOUTS]]


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    root = tmp_path_factory.mktemp("checkpoints")
    launcher = MeshLauncher(load_config([ROOT / "configs/quickstart.yaml"], overrides(root)))
    launcher.start(ready_timeout_s=120)
    try:
        rows = task_rows()
        reference = asyncio.run(run_all(launcher.url_of(ENV), rows, "ref"))
        yield Mesh(launcher, root, rows, reference)
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


# ---- the controller's side ----------------------------------------------------------------------


async def run_all(env: str, rows: list[dict[str, Any]], prefix: str) -> list[dict[str, Any]]:
    async with MeshClient() as client:
        replies = await asyncio.gather(*(
            client.request("POST", f"{env}/run", json=row, identity=RolloutIdentity(f"{prefix}{i}"),
                           timeout_s=RUN_TIMEOUT_S) for i, row in enumerate(rows)))
    return [reply.json() for reply in replies]


async def status(client: MeshClient, launcher: MeshLauncher, name: str) -> dict[str, Any]:
    reply = await client.request("GET", launcher.url_of(name) + "/ng-control/v1/checkpoint/status",
                                 headers=AUTH, rollout_prefix=False)
    result: dict[str, Any] = reply.json()
    return result


async def extras(client: MeshClient, launcher: MeshLauncher, name: str) -> dict[str, Any]:
    found: dict[str, Any] = (await status(client, launcher, name))["extras"]
    return found


def dispatch(client: MeshClient, mesh: Mesh, prefix: str) -> dict[str, asyncio.Task[Any]]:
    return {f"{prefix}{i}": asyncio.create_task(client.request(
        "POST", f"{mesh.env_url()}/run", json=row, identity=RolloutIdentity(f"{prefix}{i}"), check=False,
        timeout_s=RUN_TIMEOUT_S)) for i, row in enumerate(mesh.rows)}


async def dispatch_mid_episode(client: MeshClient, mesh: Mesh, prefix: str) -> dict[str, asyncio.Task[Any]]:
    """Dispatch every row and return once each rollout is mid-episode: the worker is paused (SIGSTOP)
    until every episode is live and its first model call admitted, so no rollout can run ahead of
    the last one admitted on a slow machine. The resources server is paused before the worker goes
    on, and this returns once every agent session is in its tool call (its first model call
    delivered): none can get a second model call or end, whatever the machine's speed, until the
    caller lets the resources server go on (``go_on``): a checkpoint once the agent is preparing
    (its sessions then park before their next call), a retire once the environment has it."""
    base = await extras(client, mesh.launcher, MODEL)
    assert mesh.launcher.kill(WORKER, signal.SIGSTOP)
    try:
        tasks = dispatch(client, mesh, prefix)
        await until_seen(client, mesh, tasks, lambda env, model, agent: (env["episodes"], model["active_calls"])
                         == (len(tasks), base["active_calls"] + len(tasks)), "every first model call admitted")
        assert mesh.launcher.kill(RESOURCES, signal.SIGSTOP)
    finally:
        mesh.launcher.kill(WORKER, signal.SIGCONT)
    await until_seen(client, mesh, tasks, lambda env, model, agent: agent["in_tool_call"] == len(tasks),
                     "every agent session in its tool call (the resources server paused)")
    return tasks


def go_on(mesh: Mesh) -> None:
    for name in (WORKER, RESOURCES):
        mesh.launcher.kill(name, signal.SIGCONT)


async def until_seen(client: MeshClient, mesh: Mesh, tasks: dict[str, asyncio.Task[Any]],
                     ok: Any, what: str) -> None:
    """Poll the environment's, the model's and the agent's status extras until ``ok(env, model, agent)``,
    no rollout ended (with the worker or the resources server paused none can: one that did failed)."""

    def seen(found: dict[str, dict[str, Any]]) -> bool:
        if ok(found[ENV]["extras"], found[MODEL]["extras"], found[AGENT]["extras"]):
            return True
        ended = {key: _reply_of(task) for key, task in tasks.items() if task.done()}
        assert not ended, f"a rollout ended while it was held: {ended}"
        return False

    await until_extras(client, mesh.launcher, (ENV, MODEL, AGENT), seen, what, interval_s=0.002)


def _reply_of(task: asyncio.Task[Any]) -> str:
    """What an ended ``/run`` task gave: its status and the start of its body, or its error."""
    if task.cancelled():
        return "cancelled"
    if (error := task.exception()) is not None:
        return repr(error)[:300]
    reply = task.result()
    return f"{reply.status_code} {reply.text[:300]}"


async def checkpoint_mid_episode(
    client: MeshClient, coordinator: Coordinator, mesh: Mesh, tasks: dict[str, asyncio.Task[Any]],
    cid: str,
) -> tuple[PrepareResult, list[RolloutIdentity]]:
    deadline = time.time() + 120
    preparing = asyncio.create_task(coordinator.prepare(cid, deadline_ts=deadline))
    await until_extras(client, mesh.launcher, (AGENT,), lambda s: s[AGENT]["phase"] == "preparing",
                       "the agent preparing (its tool calls wait at the paused resources server)")
    mesh.launcher.kill(RESOURCES, signal.SIGCONT)
    prepared = await asyncio.wait_for(preparing, WAIT_S)
    assert prepared.prepared, prepared.to_json()
    in_flight = [RolloutIdentity(key) for key, task in tasks.items() if not task.done()]
    scope = prepared.continued(in_flight)
    assert len(scope) == ROLLOUTS, "every rollout is mid-episode at the checkpoint"
    committed = await coordinator.commit(cid, deadline_ts=deadline, checkpoint_dir=str(mesh.root / cid),
                                         episode_ids=scope)
    manifests = committed.manifests()
    assert manifests[ENV]["record_count"] == ROLLOUTS and manifests[AGENT]["record_count"] == ROLLOUTS
    return prepared, scope


def index_of(episode: RolloutIdentity) -> int:
    return int(episode.rollout_id[2:])


def row_of(mesh: Mesh, episode: RolloutIdentity) -> dict[str, Any]:
    return mesh.rows[index_of(episode)]


# ---- comparing rows -----------------------------------------------------------------------------


def assert_same(actual: Any, expected: Any, where: str = "row") -> None:
    """Equal JSON, but log probabilities within ``LOGPROB_TOLERANCE`` and ``created_at`` not compared."""
    if isinstance(expected, dict):
        assert isinstance(actual, dict) and set(actual) == set(expected), f"{where}: keys differ"
        for key in expected:
            if key != "created_at":
                assert_same(actual[key], expected[key], f"{where}.{key}")
    elif isinstance(expected, list):
        assert isinstance(actual, list) and len(actual) == len(expected), f"{where}: lengths differ"
        for index, (a, b) in enumerate(zip(actual, expected, strict=True)):
            assert_same(a, b, f"{where}[{index}]")
    elif isinstance(expected, float):
        assert isinstance(actual, float) and math.isclose(actual, expected, abs_tol=LOGPROB_TOLERANCE), where
    else:
        assert actual == expected, f"{where}: {actual!r} != {expected!r}"


def assert_continued(actual: dict[str, Any], expected: dict[str, Any]) -> None:
    """Equal to the uninterrupted run's row, token arrays included: the turns made before the
    checkpoint get theirs back from the policy model's token sidecar, the later ones are spliced
    from those exact ids (never re-tokenized)."""
    assert_same(actual, expected)
    output = actual["response"]["output"]
    missing = [item["type"] for item in output if item["type"] != "function_call_output"
               and not all(field in item for field in TOKEN_FIELDS)]
    assert not missing, f"model output items without token arrays: {missing}"


def model_calls(row: dict[str, Any]) -> int:
    """The model calls of a finished row: the distinct prompts its output items were generated from."""
    output = row["response"]["output"]
    return len({tuple(item["prompt_token_ids"]) for item in output if "prompt_token_ids" in item})


def tool_calls(row: dict[str, Any]) -> int:
    return sum(1 for item in row["response"]["output"] if item["type"] == "function_call_output")


# ---- acceptance ---------------------------------------------------------------------------------


async def test_a_checkpoint_mid_episode_without_a_crash_changes_no_row(mesh: Mesh) -> None:
    async with MeshClient() as client, Coordinator(mesh.launcher.head_url, TOKEN) as coordinator:
        await coordinator.discover()
        tasks = await dispatch_mid_episode(client, mesh, "nc")
        try:
            await checkpoint_mid_episode(client, coordinator, mesh, tasks, "no-crash")
        finally:
            go_on(mesh)
            await coordinator.resume("no-crash", deadline_ts=time.time() + 60)
        replies = [await asyncio.wait_for(task, RUN_TIMEOUT_S) for task in tasks.values()]
    assert [reply.status_code for reply in replies] == [200] * ROLLOUTS
    for reply, expected in zip(replies, mesh.reference, strict=True):
        assert_same(reply.json(), expected)


async def test_a_crash_after_the_commit_continues_every_rollout_exactly_once(mesh: Mesh) -> None:
    launcher = mesh.launcher
    async with MeshClient() as client:
        async with Coordinator(launcher.head_url, TOKEN) as coordinator:
            await coordinator.discover()
            rows_before = (await extras(client, launcher, MODEL))["rows"]
            tools_before = (await extras(client, launcher, AGENT))["tool_calls"]
            tasks = await dispatch_mid_episode(client, mesh, "ck")
            try:
                prepared, scope = await checkpoint_mid_episode(client, coordinator, mesh, tasks, "crash")
                delivered = (await extras(client, launcher, MODEL))["rows"] - rows_before
                tools_made = (await extras(client, launcher, AGENT))["tool_calls"] - tools_before
            finally:
                go_on(mesh)
        await asyncio.to_thread(launcher.restart_all, 120)  # SIGKILL every server, fresh processes
        lost = await asyncio.gather(*tasks.values(), return_exceptions=True)
        assert not [r for r in lost if not isinstance(r, GymError) and r.status_code == 200], "one finished"
        async with Coordinator(launcher.head_url, TOKEN) as coordinator:
            deadline = time.time() + 120
            directory = str(mesh.root / "crash")
            restored = await coordinator.restore("back", deadline_ts=deadline, checkpoint_dir=directory,
                                                 episode_ids=scope)
            assert restored.continued() == [e.next_attempt() for e in scope] and restored.restarts() == []
            inherited = (await extras(client, launcher, MODEL))["rows"]
            await coordinator.resume("back", deadline_ts=deadline)
        continued = restored.continued() + restored.restarts()
        replies = await asyncio.gather(*(
            client.request("POST", f"{mesh.env_url()}/run", json=row_of(mesh, e), identity=e,
                           timeout_s=RUN_TIMEOUT_S) for e in continued))
        model_after = await extras(client, launcher, MODEL)
        tools_after = (await extras(client, launcher, AGENT))["tool_calls"]
    expected = [mesh.reference[index_of(e)] for e in continued]
    for reply, row in zip(replies, expected, strict=True):
        assert_continued(reply.json(), row)
    assert prepared.restarts() == set()
    assert 0 < inherited == delivered  # the delivered calls' ledger rows came back (held ones did not)
    assert model_after["rows"] == sum(model_calls(row) for row in expected)  # no model call made twice
    assert model_after["ledgers"] == ROLLOUTS
    assert tools_made + tools_after == sum(tool_calls(row) for row in expected)  # no tool call twice


async def test_retire_during_a_run_then_forget_leaves_nothing(mesh: Mesh) -> None:
    launcher = mesh.launcher
    async with MeshClient() as client, Coordinator(launcher.head_url, TOKEN) as coordinator:
        finished = [f"{prefix}{i}" for prefix in ("ref", "nc", "ck") for i in range(ROLLOUTS)]
        # collected: nothing to keep; this also discovers the participants while none is paused
        await coordinator.forget(finished, deadline_ts=time.time() + 60)
        base = (await extras(client, launcher, MODEL))["rows"]
        tasks = await dispatch_mid_episode(client, mesh, "rt")  # each in its tool call, the resources paused
        episodes = [RolloutIdentity(key) for key in tasks]
        try:
            assert (await extras(client, launcher, MODEL))["rows"] == base + ROLLOUTS  # a ledger row each
            # The resources server cannot answer the retire's last stage, nor the closes of the
            # environment's cleanup: it goes on once the environment has the retire (its episodes
            # are stopped and answer stale_attempt; none could end before, held in its tool call).
            retiring = asyncio.create_task(coordinator.retire(episodes, deadline_ts=time.time() + 60))
            await until_extras(client, launcher, (ENV,), lambda s: s[ENV]["retired_rollouts"] == ROLLOUTS,
                               "the environment retired every rollout (the resources server paused)")
            assert not [key for key, task in tasks.items() if task.done()], "a rollout ended before the retire"
        finally:
            go_on(mesh)
        await asyncio.wait_for(retiring, WAIT_S)
        replies = await asyncio.wait_for(asyncio.gather(*tasks.values()), WAIT_S)
        answers = [(reply.status_code, (reply.json().get("error") or {}).get("code")) for reply in replies]
        assert answers == [(409, "stale_attempt")] * ROLLOUTS
        statuses = await coordinator.status()
        assert all(s["retired_rollouts"] == ROLLOUTS for s in statuses.values())
        await coordinator.forget([e.rollout_id for e in episodes], deadline_ts=time.time() + 60)
        statuses = await coordinator.status()
    assert all(s["retired_rollouts"] == 0 and s["waiting_requests"] == 0 for s in statuses.values())
    by_kind = {s["kind"]: s["extras"] for s in statuses.values()}
    assert by_kind["environment"]["episodes"] == 0 and by_kind["environment"]["installed"] == 0
    assert (by_kind["agent"]["sessions"], by_kind["agent"]["running"]) == (0, 0)
    assert (by_kind["model"]["active_calls"], by_kind["model"]["held_responses"]) == (0, 0)
    assert by_kind["model"]["ledgers"] == 0
    assert (by_kind["resources"]["sessions"], by_kind["resources"]["in_flight_requests"]) == (0, 0)


# ---- a checkpoint after the agent was done ------------------------------------------------------


LATE_ROWS = [{"responses_create_params": {"input": [{"role": "user", "content": text}]}, "expected_answer": 1}
             for text in ("Say hello.", "Name a colour.")]
"""Rows the default model answers in one call without tools: after it, the next resources call is the verify."""


async def until_extras(
    client: MeshClient, launcher: MeshLauncher, names: tuple[str, ...], ok: Any, what: str,
    interval_s: float = 0.01,
) -> dict[str, dict[str, Any]]:
    """Poll the status of ``names`` until ``ok`` holds (their statuses by name), with a deadline."""
    deadline = time.monotonic() + WAIT_S
    while True:
        found = dict(zip(names, await asyncio.gather(*(status(client, launcher, n) for n in names)), strict=True))
        if ok(found):
            return found
        assert time.monotonic() < deadline, f"never: {what}; last seen {found}"
        await asyncio.sleep(interval_s)


async def admitted_at_the_paused_worker(
    client: MeshClient, mesh: Mesh, rows: dict[RolloutIdentity, dict[str, Any]]
) -> dict[RolloutIdentity, asyncio.Task[Any]]:
    """Pause the worker, dispatch ``rows``, wait until each one's model call is admitted (it stays paused)."""
    base = (await extras(client, mesh.launcher, MODEL))["active_calls"]
    assert mesh.launcher.kill(WORKER, signal.SIGSTOP)
    tasks = {identity: asyncio.create_task(client.request(
        "POST", f"{mesh.env_url()}/run", json=row, identity=identity, check=False, timeout_s=RUN_TIMEOUT_S))
        for identity, row in rows.items()}
    await until_extras(client, mesh.launcher, (MODEL,),
                       lambda s: s[MODEL]["extras"]["active_calls"] == base + len(rows),
                       "every rollout seeded, its model call admitted at the paused worker")
    return tasks


async def test_a_checkpoint_after_the_agent_was_done_keeps_every_token_array_across_a_crash(mesh: Mesh) -> None:
    launcher = mesh.launcher
    rows = {RolloutIdentity(f"late{i}"): row for i, row in enumerate(LATE_ROWS)}
    async with MeshClient() as client, Coordinator(launcher.head_url, TOKEN) as coordinator:
        await coordinator.discover()  # while nothing is paused: discovery asks every server
        tasks: dict[RolloutIdentity, asyncio.Task[Any]] = {}
        try:
            # the reference: the same calls batched the same way (all admitted, then the worker goes on),
            # as the worker's batches decide the last bits of the log probabilities
            references = await admitted_at_the_paused_worker(client, mesh, {
                RolloutIdentity(f"late-ref{i}"): row for i, row in enumerate(LATE_ROWS)})
            launcher.kill(WORKER, signal.SIGCONT)
            reference = [(await asyncio.wait_for(task, RUN_TIMEOUT_S)).json() for task in references.values()]
            tasks = await admitted_at_the_paused_worker(client, mesh, rows)
            assert launcher.kill(RESOURCES, signal.SIGSTOP)  # the next resources call of each is its verify
            launcher.kill(WORKER, signal.SIGCONT)
            await until_extras(
                client, launcher, (ENV, AGENT),
                lambda s: (s[ENV]["extras"]["in_replay_step"], s[AGENT]["extras"]["sessions"]) == (len(rows), 0),
                "every agent session closed and every episode in its verify (replay), the resources paused")
            deadline = time.time() + WAIT_S
            preparing = asyncio.create_task(coordinator.prepare("late", deadline_ts=deadline))
            await until_extras(client, launcher, (ENV, AGENT),
                               lambda s: s[ENV]["phase"] == s[AGENT]["phase"] == "prepared",
                               "the environment, model and agent prepared (the resources stage is next)")
            launcher.kill(RESOURCES, signal.SIGCONT)
            prepared = await asyncio.wait_for(preparing, WAIT_S)
            assert prepared.prepared, prepared.to_json()
            scope = prepared.continued(list(tasks))
            assert set(scope) == set(rows)
            committed = await coordinator.commit("late", deadline_ts=deadline,
                                                 checkpoint_dir=str(mesh.root / "late"), episode_ids=scope)
        finally:
            launcher.kill(WORKER, signal.SIGCONT)
            launcher.kill(RESOURCES, signal.SIGCONT)
    assert committed.manifests()[AGENT]["record_count"] == 0  # closed: only the environment holds the reply
    for record in env_records(mesh.root / "late"):
        boundary = record["boundary"]
        assert boundary["next_step"] in ("verify", "close_session"), boundary  # verify replayed, or done
        assert not any(field in item for item in boundary["state"]["response"]["output"] for field in TOKEN_FIELDS)
    await asyncio.to_thread(launcher.restart_all, 120)  # SIGKILL every server, fresh processes
    lost = await asyncio.gather(*tasks.values(), return_exceptions=True)
    assert not [r for r in lost if not isinstance(r, GymError) and r.status_code == 200], "one finished"
    async with MeshClient() as client, Coordinator(launcher.head_url, TOKEN) as coordinator:
        await coordinator.discover()
        deadline = time.time() + WAIT_S
        restored = await coordinator.restore("late-back", deadline_ts=deadline,
                                             checkpoint_dir=str(mesh.root / "late"), episode_ids=scope)
        await coordinator.resume("late-back", deadline_ts=deadline)
        continued = restored.continued()
        assert continued == [e.next_attempt() for e in scope]
        replies = await asyncio.gather(*(
            client.request("POST", f"{mesh.env_url()}/run", json=rows[RolloutIdentity(e.rollout_id)], identity=e,
                           timeout_s=RUN_TIMEOUT_S) for e in continued))
        model_after, agent_after = await extras(client, launcher, MODEL), await extras(client, launcher, AGENT)
        await coordinator.forget([e.rollout_id for e in continued], deadline_ts=time.time() + WAIT_S)
    by_rollout = {f"late{i}": row for i, row in enumerate(reference)}
    for identity, reply in zip(continued, replies, strict=True):
        assert_continued(reply.json(), by_rollout[identity.rollout_id])  # token arrays included
    assert model_after["rows"] == len(rows) and model_after["active_calls"] == 0  # the restored rows only
    assert (agent_after["model_calls"], agent_after["tool_calls"]) == (0, 0)  # the agent never ran again


def env_records(directory: Path) -> list[dict[str, Any]]:
    where = directory / "gym" / "environment" / ENV
    manifest = orjson.loads((where / "manifest.json").read_bytes())
    return [orjson.loads(line) for line in (where / manifest["records_file"]).read_bytes().splitlines()]
