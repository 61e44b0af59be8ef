"""NeMo Gym's own verifiers in our mesh, one family test each (rule, judge, code, cohort), on real processes.

One mesh (``tests/support/verifier_cases.verifier_mesh``): NeMo Gym's servers, each run from the
installed ``nemo_gym`` package in NeMo Gym's Python environment inside our participant shell, with
their declarations (stateless, replay); ``single_agent_turn`` environments, ``simple_agent``, our
policy model and a judge model in front of inference workers with the script engine. One scenario,
the family tests read its outcome:

1. an uninterrupted run of every row (rollouts ``<id>-ref``): its rewards, and NeMo Gym's rewards
   for those scripted answers (``Case.reward``);
2. the same rows again; once slow verifications are in flight (a math-verify comparison that
   takes 5 s, judge calls of a slow judge, a transform program that computes for a while, and two
   cohort members of genrm_compare waiting for their siblings), a checkpoint of every rollout in
   flight, then SIGKILL of every server and fresh processes; restore, fence, resume, and the
   continued attempts dispatched;
3. genrm_compare (two rollouts per prompt): cohort A's second member is dispatched only after the
   restore, so A's first member verifies again and rebuilds the cohort with it; cohort B's second
   member never comes, so B's cohort fails after ``cohort_collection_timeout_s`` and the controller
   retries B from input as a new group attempt (``_ng_group_attempt: 1``), both members together.

Each family test: every rollout finished exactly once, with the reward of the uninterrupted run
(the judges are scripted, so a replayed judge call gives the same verdict here), the slow ones were
checkpointed inside their verify step (``next_step: verify``) and verified again after the restore,
and no rollout was a restart (no participant listed one). ``NEMO_GYM_VERIFIERS=all`` runs every
verifier that runs here (docs/verifiers.md); the default is a lean set for CI.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from nemo_gym_ckpt.client import MeshClient
from nemo_gym_ckpt.config import NEMO_GYM_PYTHON_ENV, load_config_dict
from nemo_gym_ckpt.identity import ATTEMPT_INDEX, ROLLOUT_ID, RolloutIdentity
from nemo_gym_ckpt.launch.launcher import MeshLauncher
from tests.support.crash_scenarios import TOKEN, CrashMesh, records_of, until
from tests.support.nemo_gym_env import nemo_gym_python
from tests.support.verifier_cases import CASES, FAMILIES, rows_of, verifier_mesh

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

LEAN = ("string_match", "math_with_judge", "equivalence_llm_judge", "nvarc_inductive_resources_server",
        "genrm_compare_resources_server")
"""The CI set: one slow verifier of each family, and string_match (NeMo Gym's quickstart verifier)."""
GENRM = "genrm_compare_resources_server"
SLOW = {"math_with_judge": 2, "equivalence_llm_judge": 0, "nvarc_inductive_resources_server": 0}
"""The rows whose verification is still running when the checkpoint is taken (and its row index)."""
COHORT_TIMEOUT_S = 8
JUDGE_DELAY_S = 0.4
READY_S = 600.0
RUN_S = 300.0


def chosen() -> list[str]:
    wanted = os.environ.get("NEMO_GYM_VERIFIERS", "ci")
    names = [name for name in FAMILIES if wanted == "all" or name in LEAN]
    return names if wanted in ("all", "ci") else [name for name in names if name in wanted.split(",")]


@dataclass
class Outcome:
    """What the scenario saw: per rollout id, its rows and rewards, the records, the restarts."""

    reference: dict[str, float] = field(default_factory=dict)
    finished: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    in_verify: set[str] = field(default_factory=set)
    restarts: set[str] = field(default_factory=set)
    restored: set[str] = field(default_factory=set)
    cohort_failures: list[str] = field(default_factory=list)
    instances: list[str] = field(default_factory=list)


def rollout(instance: str, row: int, member: int = 0) -> str:
    return f"{instance.replace('_', '-')[:24]}-r{row}-m{member}"


def body(instance: str, row: dict[str, Any], index: int, member: int, group_attempt: int = 0) -> dict[str, Any]:
    """The ``/run`` body as NeMo Gym's collector sends it (task and rollout index with the row)."""
    extra = {"_ng_group_attempt": group_attempt} if instance == GENRM and group_attempt else {}
    return {**row, "_ng_task_index": index, "_ng_rollout_index": member, **extra}


def reward_of(reply: httpx.Response) -> float:
    assert reply.status_code == 200, reply.text
    return float(reply.json()["reward"])


# ---- the scenario ---------------------------------------------------------------------------------


class Scenario:
    def __init__(self, mesh: CrashMesh, instances: list[str]) -> None:
        self.mesh, self.instances, self.outcome = mesh, instances, Outcome(instances=instances)
        self.rows = {name: rows_of(FAMILIES[name]) for name in instances}

    def dispatch(self, name: str, runs: Mapping[RolloutIdentity, dict[str, Any]]) -> dict[RolloutIdentity, Any]:
        named = {identity: {**row, ROLLOUT_ID: identity.rollout_id, ATTEMPT_INDEX: identity.attempt}
                 for identity, row in runs.items()}  # the body names the rollout its prefix names
        return self.mesh.dispatch(f"env_{name}", named)

    def plan(self, suffix: str, *, genrm_members: tuple[int, ...] = (0, 1)) -> dict[str, dict[RolloutIdentity, Any]]:
        runs: dict[str, dict[RolloutIdentity, Any]] = {}
        for name in self.instances:
            members = genrm_members if name == GENRM else (0,)
            runs[name] = {RolloutIdentity(rollout(name, i, m) + suffix): body(name, row, i, m)
                          for i, row in enumerate(self.rows[name]) for m in members}
        return runs

    async def reference(self) -> None:
        tasks = {identity: task for name, runs in self.plan("-ref").items()
                 for identity, task in self.dispatch(name, runs).items()}
        for identity, reply in zip(tasks, await asyncio.gather(*tasks.values()), strict=True):
            self.outcome.reference[identity.rollout_id.removesuffix("-ref")] = reward_of(reply)

    def _finish(self, identity: RolloutIdentity, reply: Any) -> None:
        if isinstance(reply, httpx.Response) and reply.status_code == 200:
            self.outcome.finished.setdefault(identity.rollout_id, []).append(reply.json())

    async def slow_ones_in_flight(self, by_name: Mapping[str, Mapping[RolloutIdentity, asyncio.Task[Any]]]) -> None:
        """Wait until, at each slow verifier, every rollout not finished yet is inside its verify call
        (at least one; two cohort members at genrm_compare): a fast row verifying at that moment does
        not stand in for the slow one still on its way (a loaded CI run checkpointed math_with_judge's
        row 0 in verify and its slow row 2 before it)."""
        slow = [name for name in self.instances if name in SLOW]
        wanted = {name: 1 for name in slow} | ({GENRM: 2} if GENRM in self.instances else {})

        def unfinished(name: str) -> int:
            return sum(not task.done() for task in by_name[name].values())

        await until(lambda: self.mesh.counts(list(wanted)),
                    lambda now: all(now[name]["verifying_requests"] >= max(n, unfinished(name))
                                    for name, n in wanted.items()),
                    f"verifications in flight at {sorted(wanted)}", timeout_s=RUN_S)

    async def run(self) -> None:
        plan = self.plan("", genrm_members=(0,))
        by_name = {name: self.dispatch(name, runs) for name, runs in plan.items()}
        tasks = {identity: task for named in by_name.values() for identity, task in named.items()}
        await self.slow_ones_in_flight(by_name)
        scope = await self.checkpoint_and_crash(tasks)
        for identity, task in tasks.items():  # the rows that came back before the crash
            reply = await asyncio.gather(task, return_exceptions=True)
            self._finish(identity, reply[0])
        await self.restore_and_continue(plan, scope)

    async def checkpoint_and_crash(self, tasks: Mapping[RolloutIdentity, asyncio.Task[Any]]) -> list[RolloutIdentity]:
        directory = self.mesh.root / "verifiers"
        async with self.mesh.coordinator() as coordinator:
            deadline = time.time() + 60
            prepared = await coordinator.prepare("verifiers", deadline_ts=deadline)
            assert prepared.prepared, prepared.to_json()
            self.outcome.restarts = prepared.restarts()
            scope = prepared.continued([identity for identity, task in tasks.items() if not task.done()])
            await coordinator.commit("verifiers", deadline_ts=deadline, checkpoint_dir=str(directory),
                                     episode_ids=scope)
        for name in self.instances:  # the crash comes before the resume
            for key, record in records_of(directory, "environment", f"env_{name}").items():
                if (record["boundary"] or {}).get("next_step") == "verify":
                    self.outcome.in_verify.add(key)
        await self.mesh.crash(READY_S)
        return scope

    async def restore_and_continue(self, plan: Mapping[str, Mapping[RolloutIdentity, Any]],
                                   scope: list[RolloutIdentity]) -> None:
        async with self.mesh.coordinator() as coordinator:
            deadline = time.time() + 60
            restored = await coordinator.restore("verifiers-restore", deadline_ts=deadline,
                                                 checkpoint_dir=str(self.mesh.root / "verifiers"), episode_ids=scope)
            await coordinator.retire(list(scope), deadline_ts=deadline, checkpoint_id="verifiers-restore")
            await coordinator.resume("verifiers-restore", deadline_ts=deadline)
        continued = {identity.rollout_id: identity for identity in restored.continued()}
        self.outcome.restored = set(continued)
        tasks: dict[RolloutIdentity, Any] = {}
        for name, runs in plan.items():
            again = {continued[i.rollout_id]: row for i, row in runs.items() if i.rollout_id in continued}
            if name == GENRM:  # cohort A's second member comes only now; cohort B's never does
                again[RolloutIdentity(rollout(name, 0, 1))] = body(name, self.rows[name][0], 0, 1)
            tasks |= self.dispatch(name, again)
        replies = dict(zip(tasks, await asyncio.gather(*tasks.values()), strict=True))
        for identity, reply in replies.items():
            if identity.rollout_id == rollout(GENRM, 1, 0) and reply.status_code != 200:
                self.outcome.cohort_failures.append(reply.text)
                continue
            self._finish(identity, reply)
        if GENRM in self.instances:
            await self.retry_cohort_b(replies)

    async def retry_cohort_b(self, replies: Mapping[RolloutIdentity, httpx.Response]) -> None:
        """Cohort B failed: retry it from input as group attempt 1, both members, as new attempts."""
        first = next((identity for identity in replies if identity.rollout_id == rollout(GENRM, 1, 0)), None)
        if first is None:  # B was not continued from the checkpoint: the cohort test says so
            return
        retry = {RolloutIdentity(first.rollout_id, first.attempt + 1): body(GENRM, self.rows[GENRM][1], 1, 0, 1),
                 RolloutIdentity(rollout(GENRM, 1, 1)): body(GENRM, self.rows[GENRM][1], 1, 1, 1)}
        tasks = self.dispatch(GENRM, retry)
        for identity, reply in zip(tasks, await asyncio.gather(*tasks.values()), strict=True):
            self._finish(identity, reply)


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[MeshLauncher, Path, list[str]]]:
    python = nemo_gym_python()
    root = tmp_path_factory.mktemp("verifiers")
    instances = chosen()
    raw = verifier_mesh(instances, root, TOKEN, judge_delay_s=JUDGE_DELAY_S)
    if GENRM in instances:
        raw[GENRM]["resources_servers"]["genrm_compare"]["cohort_collection_timeout_s"] = COHORT_TIMEOUT_S
    raw["head_server"] = {"port": 0}
    launcher = MeshLauncher(load_config_dict(raw), env={**os.environ, NEMO_GYM_PYTHON_ENV: python})
    with launcher:
        launcher.start(ready_timeout_s=READY_S)
        yield launcher, root, instances


async def play(launcher: MeshLauncher, root: Path, instances: list[str]) -> Outcome:
    async with MeshClient() as client:
        mesh = CrashMesh(launcher, root, client)
        await mesh.discover()
        scenario = Scenario(mesh, instances)
        try:
            await scenario.reference()
            await scenario.run()
        finally:
            await mesh.cancel_all()
        return scenario.outcome


@pytest.fixture(scope="module")
def outcome(launched: tuple[MeshLauncher, Path, list[str]]) -> Outcome:
    """The scenario, played once for the module's tests (its own event loop)."""
    return asyncio.run(play(*launched))


# ---- the family tests --------------------------------------------------------------------------------


def check_family(outcome: Outcome, family: str) -> list[str]:
    """The checks every family test makes; the rollout ids of the family."""
    names = [name for name in outcome.instances if FAMILIES[name].family == family]
    assert names, f"no {family} verifier in this run"
    ids = [rollout(case.instance, case.row, m) for case in CASES if case.instance in names
           for m in ((0, 1) if case.instance == GENRM else (0,))]
    for case in CASES:
        if case.instance in names:
            assert outcome.reference[rollout(case.instance, case.row)] == case.reward, case
    for rid in ids:
        rows = outcome.finished.get(rid, [])
        assert len(rows) == 1, f"{rid} finished {len(rows)} times"
        assert float(rows[0]["reward"]) == outcome.reference[rid], (rid, rows[0]["reward"], outcome.reference[rid])
    assert not [key for key in outcome.restarts if any(key.startswith(rid) for rid in ids)], outcome.restarts
    slow = [rollout(name, SLOW[name]) for name in names if name in SLOW]
    for rid in slow:  # checkpointed inside the verify step, verified again after the restore
        assert rid in outcome.in_verify and rid in outcome.restored, (rid, sorted(outcome.in_verify))
    return ids


def test_rule_verifiers_finish_once_with_the_uninterrupted_reward(outcome: Outcome) -> None:
    check_family(outcome, "rule")


def test_judge_verifiers_finish_once_with_the_uninterrupted_reward(outcome: Outcome) -> None:
    check_family(outcome, "judge")


def test_code_verifiers_finish_once_with_the_uninterrupted_reward(outcome: Outcome) -> None:
    check_family(outcome, "code")


def test_a_cohort_cut_by_a_crash_is_rebuilt_and_one_that_cannot_complete_is_retried(outcome: Outcome) -> None:
    check_family(outcome, "cohort")
    a0, b0 = rollout(GENRM, 0, 0), rollout(GENRM, 1, 0)
    assert {a0, b0} <= outcome.in_verify and {a0, b0} <= outcome.restored  # both waited for a sibling
    assert len(outcome.cohort_failures) == 1 and "did not collect" in outcome.cohort_failures[0]
    assert outcome.finished[b0][0]["_ng_group_attempt"] == 1  # B finished as its retried group
    assert outcome.finished[a0][0]["_ng_group_attempt"] == 0  # A was rebuilt, not retried
