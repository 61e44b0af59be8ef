"""Issue 13 item 3: a controller doing what NeMo RL's Gym checkpoint adapter does drives the mesh unchanged.

The controller is ``tests/support/nemo_rl_controller.py`` (this project's code, written from the
facts of NeMo RL's adapter and NeMo Gym's coordination and store; it shares nothing with our
``Coordinator``). One mesh per case, generation cuts off and on: ``configs/quickstart.yaml`` plus
the kv_store environment of ``tests/fixtures/kv_turn.yaml``, checkpointing on without a
``checkpoint.root`` (upstream's block has none), each server its own process. The rollouts: three
calculator rows and one kv row through the environments' ``/run``, and two long chat calls on the
policy model under ``/ng-rollout/<key>/`` (still generating when the second commit cuts them).
Signals hold the mesh still (``tests/support/crash_scenarios.py``): SIGSTOP of the inference worker
holds every admitted model call, SIGSTOP of the kv_store holds kv-0's verify (a ``wait`` step).

1. discovery from the head's ``/global_config_dict_yaml``: every server but the inference worker;
2. the uninterrupted run of the same rollouts under other ids, their first model calls in one batch;
3. checkpoint ``rl-1``, kv-0 verifying at the paused kv_store, the calculator rollouts' first
   model calls at the paused worker: a prepare with a short deadline stops at the environment
   stage with ``kv-0`` its only blocker; the kv_store goes on and a second prepare of the same id
   prepares everyone; the worker answers (the policy model holds the replies); renew; commit with
   ``stop: false``; the adapter's checks, and ``staging_keys_by_episode`` against the policy model's
   records on disk; the outer ``gym_checkpoint.json`` written after every participant's manifest;
   resume with the worker paused: each calculator rollout makes its tool call and waits with its
   next model call;
4. the long calls admitted too; checkpoint ``rl-2``: prepare, the worker going on until the long
   calls are past ``CUT_AFTER`` tokens, renew, commit with ``stop: true``, the same checks and
   outer manifest; SIGKILL of every server, fresh processes on the same ports;
5. restore from the outer manifest under a new id (every reply names ``rl-2`` as its source),
   retire of the attempts N, resume; attempt N is then fenced (``stale_attempt``);
6. ``rl-2``'s episodes continue as attempts N+1, a rollout in flight that no record holds (a long
   call with cuts off) starts afresh: each rollout finishes exactly once and its row equals the
   uninterrupted run's (token arrays included, log probabilities to the collector's tolerance).
   With cuts on the long calls were cut and the restored worker served their prefixes from
   staging; with cuts off nothing was staged. Nothing is held anywhere after forget.
"""

from __future__ import annotations

import asyncio
import hashlib
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from nemo_gym_ckpt.client import MeshClient
from nemo_gym_ckpt.identity import RolloutIdentity
from tests.conftest import FIXTURES
from tests.e2e.test_checkpoint_mesh import assert_continued
from tests.support.crash_scenarios import AUTH, MODEL, TOKEN, WORKER, CrashMesh, holding, until
from tests.support.nemo_rl_controller import (
    OUTER_MANIFEST,
    CommitSummary,
    Episode,
    GymInstance,
    NemoRlController,
    load_outer_manifest,
)

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.timeout(480),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the launcher's process groups"),
]

ROOT = Path(__file__).resolve().parents[2]
ENV, AGENT, RESOURCES = "single_agent_turn", "simple_agent", "calculator_tools"
KV_ENV, KV_AGENT, KV = "kv_turn", "kv_agent", "kv_store"
MEMBERS = {ENV: "environment", KV_ENV: "environment", MODEL: "model", AGENT: "agent", KV_AGENT: "agent",
           RESOURCES: "resources", KV: "resources"}
CALCULATOR = 3
LONG_CALLS = 2
LONG_TOKENS = 200
CUT_AFTER = 12
PROMPT = "1234567890" * 5  # the default model writes on after this until its token budget ends
WAIT_S = 60.0
CALL_TIMEOUT_S = 240.0
INSTANCE = GymInstance()
STAGE_ORDER = ["environment", "model", "agent", "resources"]


def calculator_rows() -> dict[str, dict[str, Any]]:
    lines = (ROOT / "resources_servers/calculator_tools/data/quickstart.jsonl").read_bytes().splitlines()
    return {f"calc-{i}": orjson.loads(line) for i, line in enumerate(lines[:CALCULATOR])}


KV_ROWS = {"kv-0": {"responses_create_params": {"input": [{"role": "user", "content": "Say hello."}]},
                    "expected_state": {}}}
LONG = [f"long-{i}" for i in range(LONG_CALLS)]


@pytest.fixture(params=[False, True], ids=["cuts-off", "cuts-on"])
def cuts(request: pytest.FixtureRequest) -> bool:
    on: bool = request.param
    return on


# ---- the data plane ------------------------------------------------------------------------------


class Rollouts:
    """The test's rollouts on a started mesh: environment rows and long chat calls, by rollout id."""

    def __init__(self, mesh: CrashMesh, http: httpx.AsyncClient) -> None:
        self.mesh, self.http = mesh, http
        self.rows = {ENV: calculator_rows(), KV_ENV: KV_ROWS}

    def env_of(self, rollout_id: str) -> str | None:
        return next((env for env, rows in self.rows.items() if rollout_id in rows), None)

    def start(self, episode: Episode, rollout_id: str) -> asyncio.Task[Any]:
        """``episode`` running the work of ``rollout_id`` (a row's ``/run``, or a long chat call)."""
        env = self.env_of(rollout_id)
        if env is None:
            return self.mesh.start(self._long_call(episode))
        row = self.rows[env][rollout_id]
        return self.mesh.start(self.mesh.client.request(
            "POST", f"{self.mesh.launcher.url_of(env)}/run", json=row, check=False, timeout_s=CALL_TIMEOUT_S,
            identity=RolloutIdentity(episode.rollout_id, episode.attempt)))

    async def _long_call(self, episode: Episode) -> Any:
        url = f"{self.mesh.launcher.url_of(MODEL)}/ng-rollout/{episode.capture_key}/v1/chat/completions"
        body = {"model": "policy", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": LONG_TOKENS}
        return await self.http.post(url, json=body, timeout=CALL_TIMEOUT_S)

    async def admitted(self, ids: list[str], suffix: str = "") -> dict[str, asyncio.Task[Any]]:
        """Rollouts ``ids`` started (under ``<id><suffix>``) with the worker paused, each one's first
        model call admitted there: they reach the worker as one batch when it goes on."""
        episodes = {rollout_id: Episode(rollout_id + suffix) for rollout_id in ids}
        before = (await self.mesh.extras(MODEL))["active_calls"]
        self.mesh.pause(WORKER)
        tasks = {rollout_id: self.start(episode, rollout_id) for rollout_id, episode in episodes.items()}
        wanted = before + len(episodes)
        await until(lambda: self.mesh.extras(MODEL), lambda m: m["active_calls"] == wanted,
                    f"{wanted} model calls admitted at the paused worker")
        return tasks


def result_of(reply: Any) -> dict[str, Any]:
    """A finished rollout's row: the environment's reply, or the long call's assistant message."""
    assert isinstance(reply, httpx.Response) and reply.status_code == 200, reply
    body: dict[str, Any] = reply.json()
    if "choices" in body:
        message: dict[str, Any] = body["choices"][0]["message"]
        return message
    return body


def assert_same_result(rollout_id: str, actual: dict[str, Any], expected: dict[str, Any]) -> None:
    if rollout_id in LONG:
        assert actual["content"] == expected["content"], rollout_id
        assert actual["generation_token_ids"] == expected["generation_token_ids"], rollout_id
        assert actual["generation_log_probs"] == pytest.approx(expected["generation_log_probs"], abs=1e-4)
    else:
        assert_continued(actual, expected)


# ---- reading what the policy model wrote ---------------------------------------------------------


def model_records(checkpoint_dir: Path) -> dict[str, dict[str, Any]]:
    """The policy model's records by capture key, a span line (incremental) replaced by its records."""
    where = checkpoint_dir / "gym" / "model" / MODEL
    manifest = orjson.loads((where / "manifest.json").read_bytes())
    records = {}
    for line in (where / manifest["records_file"]).read_bytes().splitlines():
        record = orjson.loads(line)
        if "same_as" not in record:
            records[Episode(**record["episode_id"]).capture_key] = record
            continue
        run = (where / record["records_file"]).read_bytes()[record["offset"]:record["offset"] + record["length"]]
        assert hashlib.sha256(run).hexdigest() == record["same_as"]
        for held in map(orjson.loads, run.splitlines()):
            records[Episode(**held["episode_id"]).capture_key] = held
    return records


def assert_staging_keys_match_the_records(summary: CommitSummary, checkpoint_dir: Path) -> list[str]:
    """The model's ``staging_keys_by_episode`` names, for every record it wrote, that record's cut keys."""
    records = model_records(checkpoint_dir)
    by_record = {key: sorted(record["cut"]["staging_keys"]) if "cut" in record else []
                 for key, record in records.items()}
    assert summary.staging_keys_by_episode == by_record
    return sorted(key for keys in by_record.values() for key in keys)


def participant_manifests(checkpoint_dir: Path) -> list[Path]:
    return sorted((checkpoint_dir / "gym").glob("*/*/manifest.json"))


# ---- the controller's cycle ----------------------------------------------------------------------


async def commit_and_publish(
    controller: NemoRlController, root: Path, checkpoint_id: str, deadline: float,
    tasks: Mapping[str, asyncio.Task[Any]], prepared: Any, *, stop: bool,
) -> tuple[CommitSummary, list[str]]:
    """Commit the rollouts in flight, run the adapter's checks, then write the outer manifest."""
    candidates = [Episode(rollout_id) for rollout_id, task in tasks.items() if not task.done()]
    scope = prepared.continued(candidates)
    directory = INSTANCE.checkpoint_dir(root / checkpoint_id)
    summary = await controller.commit(checkpoint_id, deadline, directory, scope, stop=stop)
    assert set(summary.exported_episodes) <= set(scope) and summary.unowned_live_episodes == []
    staged = assert_staging_keys_match_the_records(summary, directory)
    assert summary.staging_keys() == staged
    assert not (root / checkpoint_id / OUTER_MANIFEST).exists()
    outer = controller.write_outer_manifest(root / checkpoint_id, checkpoint_id, {INSTANCE: summary})
    written_last = outer.stat().st_mtime_ns >= max(p.stat().st_mtime_ns for p in participant_manifests(directory))
    assert written_last and len(participant_manifests(directory)) == len(MEMBERS)
    return summary, staged


async def first_checkpoint(
    mesh: CrashMesh, controller: NemoRlController, root: Path, tasks: Mapping[str, asyncio.Task[Any]],
) -> list[str]:
    """``rl-1`` with kv-0's verify waiting at the paused kv_store and the calculator rollouts' first
    model calls at the paused worker: a prepare with a short deadline that kv-0 holds up at the
    environment stage, the kv_store going on, a second prepare of the same id, the worker answering
    the calls (the policy model holds the replies), renew, commit without ``stop``, resume with the
    worker paused: each calculator rollout makes its tool call and waits with its next model call
    at the worker, kv-0 verifies and ends."""
    blocked = await controller.prepare("rl-1", time.time() + 1.0)
    assert not blocked.prepared and blocked.blockers() == ["kv-0"], blocked.replies
    assert set(blocked.replies) == {ENV, KV_ENV}  # the prepare stopped at the environment stage
    assert (await mesh.status(MODEL))["phase"] == "idle"
    mesh.proceed(KV)
    deadline = time.time() + WAIT_S
    prepared = await controller.prepare("rl-1", deadline)  # the same id again: it goes on from there
    assert prepared.prepared and prepared.restarts() == set(), prepared.replies
    mesh.proceed(WORKER)
    await until(lambda: mesh.extras(MODEL), lambda m: m["held_responses"] == CALCULATOR,
                "the calculator rollouts' first replies held by the policy model")
    await controller.renew("rl-1", deadline)
    _, staged = await commit_and_publish(controller, root, "rl-1", deadline, tasks, prepared, stop=False)
    mesh.pause(WORKER)
    await controller.resume("rl-1", deadline)

    async def waiting() -> tuple[int, int]:
        running = [r for r, task in tasks.items() if r != "kv-0" and not task.done()]
        return (await mesh.extras(MODEL))["active_calls"], len(running)

    await until(waiting, lambda w: w == (CALCULATOR, CALCULATOR) and tasks["kv-0"].done(),
                "every calculator rollout waiting with its next call at the paused worker")
    return staged


async def second_checkpoint(
    mesh: CrashMesh, controller: NemoRlController, root: Path, tasks: Mapping[str, asyncio.Task[Any]],
) -> tuple[CommitSummary, list[str]]:
    """``rl-2`` with every call waiting at the paused worker: prepare (the policy model holds what
    the worker answers from then on), the worker going on until the long calls generate past
    ``CUT_AFTER`` tokens, renew, commit with ``stop`` (with cuts on, it cuts them mid-generation)."""
    deadline = time.time() + WAIT_S
    prepared = await controller.prepare("rl-2", deadline)
    assert prepared.prepared and prepared.restarts() == set(), prepared.replies
    mesh.proceed(WORKER)
    await generating(mesh)
    await controller.renew("rl-2", deadline)
    return await commit_and_publish(controller, root, "rl-2", deadline, tasks, prepared, stop=True)


async def generating(mesh: CrashMesh) -> None:
    """Until every long call generates on the worker past ``CUT_AFTER`` tokens (and has not ended)."""

    async def live() -> list[int]:
        reply = await mesh.client.get_json(f"{mesh.launcher.url_of(WORKER)}/ng-control/v1/generation-cut/status",
                                           headers=AUTH, rollout_prefix=False)
        assert isinstance(reply, dict)
        return [g["tokens"] for g in reply["live_generations"] if not g["finished"]]

    await until(live, lambda tokens: len([t for t in tokens if t >= CUT_AFTER]) >= LONG_CALLS,
                f"{LONG_CALLS} long calls generating past {CUT_AFTER} tokens")


async def worker_status(mesh: CrashMesh) -> dict[str, Any]:
    reply = await mesh.client.get_json(f"{mesh.launcher.url_of(WORKER)}/ng-control/v1/generation-cut/status",
                                       headers=AUTH, rollout_prefix=False)
    assert isinstance(reply, dict)
    return reply


async def restore_from(
    controller: NemoRlController, root: Path, checkpoint_id: str
) -> tuple[list[Episode], set[str]]:
    """Restore the outer manifest's episodes under a new id, retire the attempts N, resume."""
    source, instances, _ = load_outer_manifest(root / checkpoint_id)
    scope = instances[INSTANCE.instance_id]
    deadline = time.time() + WAIT_S
    replies = await controller.restore("rl-restore", deadline, INSTANCE.checkpoint_dir(root / checkpoint_id), scope,
                                       source_checkpoint_id=source)
    assert source == checkpoint_id and {reply["source_checkpoint_id"] for reply in replies.values()} == {source}
    await controller.retire("rl-restore", deadline, scope)
    await controller.resume("rl-restore", deadline)
    return scope, {key for reply in replies.values() for key in reply["restored"]}


# ---- the test ------------------------------------------------------------------------------------


async def test_a_nemo_rl_style_controller_checkpoints_crashes_restores_and_continues(
    tmp_path: Path, launch_mesh: Any, cuts: bool
) -> None:
    overrides = ["checkpoint.enabled=true", f"checkpoint.control_auth_token={TOKEN}",
                 f"inference_worker.responses_api_models.inference_worker.staging_dir={tmp_path / 'staging'}",
                 f"policy_model.responses_api_models.policy_model.generation_cuts={str(cuts).lower()}"]
    launcher = launch_mesh(ROOT / "configs/quickstart.yaml", FIXTURES / "kv_turn.yaml", overrides=overrides,
                           ready_timeout_s=180.0)
    root = tmp_path / "training-checkpoints"
    async with MeshClient() as client, httpx.AsyncClient(trust_env=False, timeout=CALL_TIMEOUT_S) as http:
        mesh = CrashMesh(launcher, root, client)
        controller = NemoRlController(launcher.head_url, TOKEN, http)
        rollouts = Rollouts(mesh, http)
        try:
            members = await controller.discover()
            assert {m.name: m.kind for m in members} == MEMBERS  # the inference worker is no participant
            assert [m.kind for m in members] == sorted((m.kind for m in members), key=STAGE_ORDER.index)

            references = await rollouts.admitted([*rollouts.rows[ENV], *KV_ROWS, *LONG], "-ref")
            mesh.proceed(WORKER)
            expected = {rollout_id: result_of(await task) for rollout_id, task in references.items()}
            await controller.forget("forget-ref", time.time() + WAIT_S, [f"{r}-ref" for r in expected])

            tasks = await rollouts.admitted(["kv-0"])
            mesh.pause(KV)  # kv-0's verify will wait there: the blocker of rl-1's first prepare
            mesh.proceed(WORKER)
            await until(lambda: mesh.extras(KV_ENV), lambda e: e["in_wait_step"] == 1, "kv-0's verify in flight")
            tasks |= await rollouts.admitted(list(rollouts.rows[ENV]))
            staged_first = await first_checkpoint(mesh, controller, root, tasks)
            tasks |= await rollouts.admitted(LONG)
            summary, staged = await second_checkpoint(mesh, controller, root, tasks)
            finished = {rollout_id: task for rollout_id, task in tasks.items() if task.done()}
            await mesh.crash()  # SIGKILL of every server, fresh processes on the same ports
            lost = await asyncio.gather(*(t for r, t in tasks.items() if r not in finished), return_exceptions=True)
            assert not [o for o in lost if isinstance(o, httpx.Response) and o.status_code == 200]

            scope, restored = await restore_from(controller, root, "rl-2")
            assert sorted(scope) == sorted(summary.exported_episodes)
            assert restored == {e.next_attempt().capture_key for e in scope}  # every one continues
            fenced = await http.post(f"{launcher.url_of(MODEL)}/ng-rollout/{scope[0].capture_key}/v1/chat/completions",
                                     json={"model": "policy", "messages": [{"role": "user", "content": "hi"}]})
            assert fenced.status_code == 409 and fenced.json()["error"]["code"] == "stale_attempt"
            # the scope continues as attempts N+1; a rollout in flight that no record holds starts afresh
            restarted = [Episode(r) for r in tasks if r not in finished and Episode(r) not in scope]
            again = {e.rollout_id: rollouts.start(e.next_attempt(), e.rollout_id) for e in [*scope, *restarted]}
            results = {r: result_of(await task) for r, task in again.items()}
            results |= {r: result_of(task.result()) for r, task in finished.items()}
            staging = await worker_status(mesh)
            await controller.forget("forget-all", time.time() + WAIT_S, list(tasks))
            statuses = {m.name: await mesh.status(m.name) for m in members}
        finally:
            await mesh.cancel_all()
            mesh.proceed_all()
    assert sorted(results) == sorted(expected) and not set(again) & set(finished)  # each exactly once
    for rollout_id, row in results.items():
        assert_same_result(rollout_id, row, expected[rollout_id])
    assert any(e.rollout_id in rollouts.rows[ENV] for e in scope)
    if cuts:  # the long calls were cut at both commits: they continue
        assert {e.rollout_id for e in scope} >= set(LONG)
        assert len(staged) >= LONG_CALLS
        assert staging["tokens_from_staging"] > 0  # the continued long calls took their prefixes from staging
    else:
        assert staged_first == staged == [] and staging["tokens_from_staging"] == 0
    assert holding(statuses) == [], holding(statuses)

