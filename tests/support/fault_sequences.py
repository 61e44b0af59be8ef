"""Random fault sequences over the real quickstart mesh, seeded and reproducible (issue 6 item 4).

A ``Scenario`` draws a plan of operations from ``random.Random(seed)`` (the plan depends on the
seed only), runs it against the quickstart mesh (``configs/quickstart.yaml``, greedy, one process
per server, launched by ``MeshLauncher``), then checks the invariants. Operations:

- ``start``: fresh processes for the whole mesh, then the controller's ``begin`` (nothing to restore);
- ``dispatch k``: send the ``/run`` of the next ``k`` attempts waiting to go;
- ``run ms``: let the mesh run (a delay drawn from the RNG; no invariant depends on it);
- ``progress calls``: let it run until the agent completed ``calls`` more model calls (or nothing is
  in flight), so that what follows hits rollouts mid-episode however fast the machine is;
- ``checkpoint``: prepare, commit, publish, and resume (``then=resume``), or SIGKILL right after
  publishing, before any resume (``then=crash``), or a crash ``ms`` after the checkpoint started,
  wherever it stands then (``then=crash-during``);
- ``crash``: SIGKILL every server process, or a subset first and the rest ``ms`` later; then fresh
  processes for the whole mesh and the controller's ``begin`` on them: restore the latest published
  checkpoint with the unfinished rollouts it continued (dispatched as attempt N+1), fence every other
  attempt ever dispatched by retire, resume; restarts and the rest start over as a new attempt;
- ``retire``: retire a random rollout in flight; then dispatch it afresh as its next attempt now
  (``afresh``), or leave it to the next restore or the final drain (``later``);
- ``drain`` (always last): dispatch whatever is left until every rollout has its row, then the
  controller's final housekeeping (forget every finished rollout).

Invariants, checked at the end (and the checkpoint files also after every checkpoint): every
rollout has exactly one row; the rows (rewards included) equal the uninterrupted reference run's
(``rollouts.compare_rows``: token arrays of calls made before a checkpoint may be missing);
completed model calls are at most what the dispatched attempts could make, each at most as many
as its whole rollout took in the reference (2 per rollout here: "model calls at most 2 x
attempts"). They are counted by the agent (``model_calls`` in its status, read before each kill and
summed over the processes): the policy model's ledger rows shrink on retire and forget and come back
on a restore, and the worker counts tokens, not calls; every committed participant
checkpoint verifies (manifest, records SHA-256 and count, through ``CheckpointStore.read``), every
published one lists only manifests that exist, and a directory restored from is never modified;
finally every participant is idle and holds nothing (no episodes, sessions, active calls, ledgers,
retired marks, waiting requests; no live generation on the worker).

Why this controller: the collector's own pieces run in this process, driven op by op:
``CollectionControl`` (what ``nemo-gym-ckpt collect --checkpoint-dir`` runs: prepare asked again
until ready, the commit scope, ``collection.json`` and ``LATEST``, retention, the restore on fresh
processes with its fencing from ``dispatched.jsonl``, retires of failed attempts, batched forgets)
and its ``Dispatcher`` (the ``/run`` of each attempt, output and failure rows, pause during a
checkpoint), over the ``Coordinator``. Driving the ``collect`` command with signals instead would
add only argument parsing and the launch (``tests/e2e/test_collect*.py`` cover those with SIGUSR1,
SIGTERM and reruns), but could neither retire a chosen rollout, nor kill a subset of the servers at
a chosen moment, nor read the counters of the processes just before they die; here the new code is
the plan and the checks, and the product code does all the controlling.

A failure raises ``ScenarioFailed`` whose message starts with ``seed=<n>``, lists the operations as
they ran (with what each saw) and the command that replays the seed.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import io
import logging
import random
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nemo_gym_ckpt.checkpoint.coordinator import Coordinator
from nemo_gym_ckpt.checkpoint.store import MANIFEST_NAME, CheckpointStore
from nemo_gym_ckpt.client import MeshClient
from nemo_gym_ckpt.collect.control import CollectionControl, ControlSettings, Published
from nemo_gym_ckpt.collect.dispatch import Dispatcher, Plan, Summary, _Sinks, run_plan
from nemo_gym_ckpt.collect.progress import Progress
from nemo_gym_ckpt.collect.published import (
    DISPATCH_LOG,
    RunIdentity,
    config_digest,
    input_digest,
    load_published,
)
from nemo_gym_ckpt.collect.rows import JsonlAppender, compare_rows, failures_path, read_jsonl, rollout_id
from nemo_gym_ckpt.config import MeshConfig, load_config
from nemo_gym_ckpt.errors import GymError
from nemo_gym_ckpt.identity import RolloutIdentity
from nemo_gym_ckpt.launch.launcher import MeshLauncher

__all__ = ["FaultMesh", "Op", "Scenario", "ScenarioFailed", "draw_plan", "model_calls", "replay_command"]

logger = logging.getLogger(__name__)

PROJECT = Path(__file__).resolve().parents[2]
QUICKSTART = PROJECT / "configs" / "quickstart.yaml"
TASKS = PROJECT / "resources_servers" / "calculator_tools" / "data" / "quickstart.jsonl"
ENV, AGENT = "single_agent_turn", "simple_agent"
WORKER = "inference_worker"
CONTROL_STATUS = "/ng-control/v1/checkpoint/status"
WORKER_STATUS = "/ng-control/v1/generation-cut/status"
READY_S = 120.0
CALL_S = 60.0
ROLLOUT_S = 120.0
TEST_FILE = "tests/e2e/test_fault_sequences.py"


def replay_command(seed: int, *, rollouts: int = 16, steps: int = 12, crashes: int = 2) -> str:
    """The command that runs ``seed`` again (sizes other than the defaults included)."""
    sizes = {"NGC_FAULT_ROLLOUTS": (rollouts, 16), "NGC_FAULT_STEPS": (steps, 12), "NGC_FAULT_CRASHES": (crashes, 2)}
    env = "".join(f"{name}={value} " for name, (value, default) in sizes.items() if value != default)
    return f"{env}NGC_FAULT_SEED={seed} .venv/bin/python -m pytest {TEST_FILE}"


# ---- the plan -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Op:
    """One planned operation: its name and its arguments, all drawn from the seed."""

    name: str
    args: tuple[tuple[str, Any], ...] = ()

    def arg(self, key: str) -> Any:
        return dict(self.args)[key]

    def __str__(self) -> str:
        return " ".join([self.name, *(f"{key}={value}" for key, value in self.args)])


def _subset(rng: random.Random, servers: list[str]) -> str:
    """``all``, or a comma-separated proper subset killed first."""
    if rng.random() < 0.5:
        return "all"
    return ",".join(sorted(rng.sample(servers, rng.randint(1, len(servers) - 1))))


def draw_plan(seed: int, servers: list[str], *, steps: int = 12, max_crashes: int = 2) -> list[Op]:
    """``start``, a first ``dispatch``, ``steps`` operations drawn from ``seed``, ``drain``; at most
    ``max_crashes`` crashes (each costs a restart of the mesh, seconds)."""
    rng = random.Random(seed)
    ops, crashes = [Op("start"), Op("dispatch", (("k", rng.randint(2, 8)),))], 0
    kinds, weights = ["dispatch", "run", "progress", "checkpoint", "crash", "retire"], [4, 2, 2, 2, 1, 2]
    for _ in range(steps):
        kind = rng.choices(kinds, weights)[0]
        if kind == "crash" and crashes >= max_crashes:
            kind = "run"
        if kind == "dispatch":
            ops.append(Op("dispatch", (("k", rng.randint(1, 8)),)))
        elif kind == "run":
            ops.append(Op("run", (("ms", rng.randint(0, 200)),)))
        elif kind == "progress":
            ops.append(Op("progress", (("calls", rng.randint(1, 6)),)))
        elif kind == "checkpoint":
            then = rng.choice(["resume", "resume", "crash", "crash-during"])
            if then != "resume" and crashes >= max_crashes:
                then = "resume"
            args: tuple[tuple[str, Any], ...] = (("then", then),)
            if then != "resume":
                crashes += 1
                args += (("kill", _subset(rng, servers)), ("ms", rng.randint(0, 100)))
            ops.append(Op("checkpoint", args))
        elif kind == "crash":
            crashes += 1
            ops.append(Op("crash", (("kill", _subset(rng, servers)), ("ms", rng.randint(0, 100)))))
        else:
            ops.append(Op("retire", (("pick", round(rng.random(), 3)), ("then", rng.choice(["afresh", "later"])))))
    return [*ops, Op("drain")]


# ---- the mesh and its reference ------------------------------------------------------------------


@dataclass
class FaultMesh:
    """The quickstart mesh with checkpointing on, its task rows and the uninterrupted reference rows."""

    launcher: MeshLauncher
    token: str
    tasks: list[dict[str, Any]]
    reference: list[dict[str, Any]]
    identity: RunIdentity

    @classmethod
    def overrides(cls, root: Path, token: str) -> list[str]:
        return ["head_server.port=0", "checkpoint.enabled=true", f"checkpoint.root={root}",
                f"checkpoint.control_auth_token={token}"]

    @classmethod
    def config(cls, root: Path, token: str) -> MeshConfig:
        return load_config([QUICKSTART], cls.overrides(root, token))

    @staticmethod
    def task_rows(count: int) -> list[dict[str, Any]]:
        tasks = list(read_jsonl(TASKS))[:count]
        assert len(tasks) == count, f"{TASKS} holds fewer than {count} task rows"
        return tasks

    @classmethod
    async def reference_rows(cls, launcher: MeshLauncher, token: str, tasks: list[dict[str, Any]], output: Path
                             ) -> list[dict[str, Any]]:
        """The uninterrupted run (the collector without a controller); then its rollouts are forgotten."""
        plan = Plan(ENV, launcher.url_of(ENV), tasks, output, 1, len(tasks), ROLLOUT_S)
        summary = await run_plan(plan, stream=io.StringIO())
        assert summary.finished == len(tasks), f"the reference run failed {summary.failed} rollouts"
        async with Coordinator(launcher.head_url, token) as coordinator:  # collected: nothing to keep
            await coordinator.forget([rollout_id(i, 0) for i in range(len(tasks))], deadline_ts=time.time() + CALL_S)
        return list(read_jsonl(output))

    @property
    def root(self) -> Path:
        root = self.launcher.config.checkpoint.root
        assert root is not None
        return Path(root)

    @classmethod
    def identity_of(cls, mesh: MeshConfig, tasks: list[dict[str, Any]]) -> RunIdentity:
        return RunIdentity(config_digest(mesh.raw), input_digest(tasks), 1)


def model_calls(row: dict[str, Any]) -> int:
    """Model calls of a reference row: the distinct prompts its output items were generated from."""
    output = row["response"]["output"]
    return len({tuple(item["prompt_token_ids"]) for item in output if "prompt_token_ids" in item})


# ---- running a scenario ---------------------------------------------------------------------------


class ScenarioFailed(AssertionError):
    """An invariant broke, or an operation did not end in time (``Scenario.run`` adds the report as a note)."""


class _Crashed(Exception):
    """Raised by the after-publish hook once the servers were killed."""


@dataclass
class _Life:
    """The controller and dispatcher of one set of server processes (until the next crash)."""

    control: CollectionControl
    dispatcher: Dispatcher
    sinks: _Sinks
    pending: deque[RolloutIdentity]
    batches: list[asyncio.Task[None]] = field(default_factory=list)


async def _within(awaitable: Awaitable[Any], timeout_s: float, what: str) -> Any:
    try:
        return await asyncio.wait_for(awaitable, timeout_s)
    except TimeoutError:
        raise ScenarioFailed(f"not within {timeout_s:g} s: {what}") from None


class Scenario:
    """One seeded run of fault operations over ``mesh``; ``run()`` raises ``ScenarioFailed``."""

    def __init__(self, mesh: FaultMesh, seed: int, workdir: Path, *, steps: int = 12, max_crashes: int = 2,
                 plan: list[Op] | None = None) -> None:
        self.mesh, self.seed = mesh, seed
        self.plan = plan or draw_plan(seed, mesh.launcher.names, steps=steps, max_crashes=max_crashes)
        self.replay = replay_command(seed, rollouts=len(mesh.tasks), steps=steps, crashes=max_crashes)
        self.ran: list[str] = []
        self.directory = mesh.root / f"faults-{seed}-{workdir.name}"
        self.output = workdir / "rows.jsonl"
        self.rollouts = [rollout_id(index, 0) for index in range(len(mesh.tasks))]
        self.ref_calls = {rid: model_calls(row) for rid, row in zip(self.rollouts, mesh.reference, strict=True)}
        self.calls_before = 0  # completed model calls of the agent processes that crashes ended
        self.calls_now = 0  # those of the running agent process, as last read
        self.restored_from: dict[Path, str] = {}
        self.life: _Life | None = None
        self.client = MeshClient()

    # -- the report --

    def report(self) -> str:
        """``seed=<n>``, the operations as they ran (what each saw), those not reached, the replay."""
        lines = [f"seed={self.seed}", "operations (what each saw after the arrow):"]
        lines += [f"  {index:2d}. {line}" for index, line in enumerate(self.ran, start=1)]
        reached = sum(1 for line in self.ran if not line.startswith("(check)"))
        lines += [f"      (not reached) {op}" for op in self.plan[reached:]]
        lines.append(f"replay: {self.replay}")
        return "\n".join(lines)

    def _note(self, op: Op, seen: str) -> None:
        self.ran.append(f"{op} -> {seen}")

    # -- the whole run --

    async def run(self) -> None:
        try:
            for op in self.plan:
                seen = await getattr(self, f"_op_{op.name}")(op)
                self._note(op, seen)
                if self.life is not None and op.name != "drain":
                    await self.life.control.housekeeping()
            await self._check_all()
        except BaseException as error:
            error.add_note(self.report())
            raise
        finally:
            await self._end_life()
            await self.client.aclose()

    # -- operations --

    async def _op_start(self, op: Op) -> str:
        """Fresh processes, unless the mesh holds nothing (a previous scenario checked it): a restart
        costs seconds, better spent on crashes."""
        try:
            held = await self._held()
        except GymError as error:  # a scenario that failed may leave dead processes behind
            held = [error.detail]
        if held:
            await asyncio.to_thread(self.mesh.launcher.restart_all, READY_S)
        await self._count_calls_now()
        self.calls_before, self.calls_now = -self.calls_now, 0  # the calls of earlier scenarios
        return ("fresh processes; " if held else "the idle mesh; ") + await self._begin()

    async def _op_dispatch(self, op: Op) -> str:
        life = self._life()
        batch = [life.pending.popleft() for _ in range(min(op.arg("k"), len(life.pending)))]
        if not batch:
            return "nothing waits"
        await self._send(batch)
        return "sent " + " ".join(e.capture_key for e in batch)

    async def _op_run(self, op: Op) -> str:
        await asyncio.sleep(op.arg("ms") / 1000)
        return f"{len(self._life().dispatcher.in_flight())} in flight"

    async def _op_progress(self, op: Op) -> str:
        """Until the agent completed ``calls`` more model calls, or nothing is in flight (a deadline:
        rollouts in flight that make no progress fail the scenario)."""
        life = self._life()
        await self._count_calls_now()
        goal = self.calls_now + op.arg("calls")
        deadline = time.monotonic() + CALL_S
        while self.calls_now < goal and life.dispatcher.in_flight():
            if time.monotonic() > deadline:
                raise ScenarioFailed(f"no model call completed for {CALL_S:g} s with rollouts in flight")
            await asyncio.sleep(0.005)
            await self._count_calls_now()
        return f"{self.calls_now - goal + op.arg('calls')} calls; {len(life.dispatcher.in_flight())} in flight"

    async def _op_checkpoint(self, op: Op) -> str:
        life = self._life()
        then, dispatcher = op.arg("then"), life.dispatcher
        if then == "crash":
            life.control.after_publish = self._crash_hook(op.arg("kill"))
        dispatcher.pause()
        taking = asyncio.create_task(life.control.checkpoint(dispatcher.in_flight, dispatcher.rows_done))
        if then == "crash-during":
            await asyncio.wait({taking}, timeout=op.arg("ms") / 1000)
            await self._kill(op.arg("kill"))
            return await self._after_crash(op.arg("kill"), op.arg("ms"), taking)
        published = await self._outcome(taking)
        if then == "crash":
            if not isinstance(published, _Crashed):
                raise ScenarioFailed(f"the checkpoint was not published (crash hook not reached): {published}")
            return f"published, killed {op.arg('kill')} before resume; " + await self._after_crash(
                op.arg("kill"), op.arg("ms"))
        dispatcher.unpause()
        if not isinstance(published, Published):
            raise ScenarioFailed(f"a checkpoint without any fault was not published: {published}")
        self._verify_checkpoints()
        return self._published(published)

    async def _op_crash(self, op: Op) -> str:
        await self._kill(op.arg("kill"))
        return await self._after_crash(op.arg("kill"), op.arg("ms"))

    async def _op_retire(self, op: Op) -> str:
        life = self._life()
        in_flight = sorted(life.dispatcher.in_flight(), key=lambda e: e.capture_key)
        if not in_flight:
            return "nothing in flight"
        episode = in_flight[min(int(op.arg("pick") * len(in_flight)), len(in_flight) - 1)]
        await life.control.coordinator.retire([episode], deadline_ts=time.time() + CALL_S)
        await self._until(lambda: episode.capture_key not in {e.capture_key for e in life.dispatcher.in_flight()},
                          f"the /run of retired {episode.capture_key} answers")
        if episode.rollout_id in self._done():
            return f"retired {episode.capture_key}, which had finished first"
        if op.arg("then") == "afresh":
            again = RolloutIdentity(episode.rollout_id, self._highest(episode.rollout_id) + 1)
            await self._send([again])
            return f"retired {episode.capture_key}; sent {again.capture_key}"
        return f"retired {episode.capture_key}; left for later"

    async def _op_drain(self, op: Op) -> str:
        rounds = 0
        life = self._life()
        while True:
            batch = list(life.pending)
            life.pending.clear()
            await self._send(batch)
            await self._settle(life)
            left = [rid for rid in self.rollouts if rid not in self._done()]
            if not left:
                break
            rounds += 1
            if rounds > 2:
                raise ScenarioFailed(f"rollouts never finish: {left}; failures: {self._failures(left)}")
            life.pending.extend(RolloutIdentity(rid, self._highest(rid) + 1) for rid in left)
        await life.control.housekeeping(final=True)
        return f"every rollout done ({rounds} extra rounds)"

    # -- a life of the mesh: begin, dispatch, crash --

    def _life(self) -> _Life:
        assert self.life is not None, "no mesh is running"
        return self.life

    async def _begin(self) -> str:
        """The controller on fresh processes: restore, fence, resume; what it answers waits to go."""
        mesh = self.mesh
        coordinator = Coordinator(mesh.launcher.head_url, mesh.token, required_kinds=("model",))
        settings = ControlSettings(self.directory, mesh.identity, timeout_s=CALL_S, prepare_poll_s=5.0)
        control = CollectionControl(coordinator, settings)
        left = [rid for rid in self.rollouts if rid not in self._done()]
        attempts = await control.begin(left)
        restored = control.restored
        if restored.source is not None:
            source = self.directory / restored.source.checkpoint_id
            self.restored_from.setdefault(source, _tree_digest(source))
        sinks = _Sinks(JsonlAppender(self.output), JsonlAppender(failures_path(self.output)),
                       Progress(len(attempts), io.StringIO()))
        summary = Summary(planned=len(self.rollouts), skipped=len(self.rollouts) - len(left))
        plan = Plan(ENV, mesh.launcher.url_of(ENV), mesh.tasks, self.output, 1, len(mesh.tasks), ROLLOUT_S)
        self.life = _Life(control, Dispatcher(plan, self.client, sinks, summary, control), sinks, deque(attempts))
        source_id = restored.source.checkpoint_id if restored.source else None
        return (f"restored {source_id}: continue {[e.capture_key for e in restored.continued]}, "
                f"start over {restored.restarted}, fenced {len(restored.fenced)}; {len(attempts)} wait")

    async def _send(self, batch: list[RolloutIdentity]) -> None:
        """Hand ``batch`` to the dispatcher and return once each ``/run`` is on its way (logged)."""
        life = self._life()
        if batch:
            work = [((int(e.rollout_id.split("-")[0]), 0), e) for e in batch]
            life.batches.append(asyncio.create_task(life.dispatcher.run(work)))
            await self._until(lambda: set(batch) <= set(self._dispatched()), "the dispatcher sends the batch")

    async def _settle(self, life: _Life) -> None:
        """Every ``/run`` sent answered; a dispatcher that broke (not a failure row) fails the scenario."""
        if life.batches:
            await _within(asyncio.wait(life.batches), ROLLOUT_S, "every /run sent answers")
        for batch in life.batches:
            if batch.exception() is not None:
                raise ScenarioFailed(f"the dispatcher broke: {batch.exception()!r}")
        life.batches.clear()

    def _crash_hook(self, kill: str) -> Callable[[Published], Awaitable[None]]:
        async def crash(published: Published) -> None:
            await self._kill(kill)
            raise _Crashed(published.manifest.checkpoint_id)

        return crash

    async def _kill(self, kill: str) -> None:
        """SIGKILL ``kill`` (``all`` or names); the agent's count of completed model calls is read first."""
        await self._count_calls_now()
        for name in self.mesh.launcher.names if kill == "all" else kill.split(","):
            self.mesh.launcher.kill(name)

    async def _count_calls_now(self) -> None:
        """Remember the agent's count of completed model calls (a dead agent keeps the last one read).

        Read just before a kill, it may miss calls completed in between: the bound is only loosened."""
        url = self.mesh.launcher.url_of(AGENT) + CONTROL_STATUS
        with contextlib.suppress(GymError):
            status = await self.client.get_json(url, headers=self._auth(), rollout_prefix=False, timeout_s=5.0)
            self.calls_now = int(status["extras"]["model_calls"])

    async def _after_crash(self, kill: str, ms: int, taking: asyncio.Task[Published | None] | None = None
                           ) -> str:
        """The survivors run ``ms`` against dead peers, then die too (a checkpoint under way ends);
        fresh processes for the whole mesh; the controller's ``begin`` on them."""
        seen = f"killed {kill}"
        if kill != "all":
            await asyncio.sleep(ms / 1000)
            if AGENT not in kill.split(","):
                await self._count_calls_now()
        await asyncio.to_thread(self.mesh.launcher.kill_all)
        if taking is not None:
            seen += "; checkpoint " + self._published(await self._outcome(taking))
        broke = await self._end_life()  # the controller of that life ends too: what it had not sent is never sent
        if broke:
            raise ScenarioFailed(f"the dispatcher broke: {broke[0]!r}")
        self.calls_before, self.calls_now = self.calls_before + self.calls_now, 0
        await asyncio.to_thread(self.mesh.launcher.restart, *self.mesh.launcher.names, ready_timeout_s=READY_S)
        return f"{seen}; fresh processes; " + await self._begin()

    async def _end_life(self) -> list[BaseException]:
        """Cancel what is still sending, close the controller; what broke the dispatcher (not a failure row)."""
        life, self.life = self.life, None
        if life is None:
            return []
        for batch in life.batches:
            batch.cancel()
        ended = await asyncio.gather(*life.batches, return_exceptions=True)
        life.control.close()
        await life.control.coordinator.aclose()
        life.sinks.rows.close()
        life.sinks.failures.close()
        return [e for e in ended if isinstance(e, BaseException) and not isinstance(e, asyncio.CancelledError)]

    async def _outcome(self, taking: asyncio.Task[Published | None]) -> Published | BaseException | None:
        try:
            return await _within(asyncio.shield(taking), CALL_S * 3, "the checkpoint ends")
        except (_Crashed, GymError) as error:
            return error

    @staticmethod
    def _published(published: Published | BaseException | None) -> str:
        if isinstance(published, Published):
            manifest = published.manifest
            return (f"published {manifest.checkpoint_id}: continue {manifest.continued}, "
                    f"start over {manifest.restarted}")
        return f"not published ({published!r})" if published is not None else "not published"

    # -- what the files and the servers say --

    def _auth(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.mesh.token}"}

    def _done(self) -> set[str]:
        rows = read_jsonl(self.output, complete_lines_only=True)
        return {rollout_id(row["_ng_task_index"], row["_ng_rollout_index"]) for row in rows}

    def _dispatched(self) -> list[RolloutIdentity]:
        return [RolloutIdentity(r["rollout_id"], r["attempt"]) for r in read_jsonl(self.directory / DISPATCH_LOG)]

    def _highest(self, rid: str) -> int:
        return max((e.attempt for e in self._dispatched() if e.rollout_id == rid), default=-1)

    def _failures(self, rollouts: list[str]) -> list[str]:
        rows = read_jsonl(failures_path(self.output))
        return [f"{rollout_id(r['_ng_task_index'], 0)}-a{r['_ng_attempt_index']}: {r['_ng_failure_class']}"
                for r in rows if rollout_id(r["_ng_task_index"], 0) in rollouts]

    async def _until(self, condition: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + CALL_S
        while not condition():
            if time.monotonic() > deadline:
                raise ScenarioFailed(f"not within {CALL_S:g} s: {what}")
            await asyncio.sleep(0.005)

    def _verify_checkpoints(self) -> None:
        """Every participant manifest under the directory verifies; every published one lists existing ones."""
        store = CheckpointStore(self.mesh.root)
        for manifest in sorted(self.directory.glob(f"*/gym/*/*/{MANIFEST_NAME}")):
            instance = manifest.parent
            checkpoint = instance.parents[2]
            try:
                store.read(checkpoint, instance.parent.name, instance.name, frozenset())
            except GymError as error:
                raise ScenarioFailed(f"committed checkpoint {instance} does not verify: {error.detail}") from None
        for checkpoint in self.directory.glob("ckpt-*"):
            published = load_published(checkpoint)
            collection = checkpoint / "collection.json"
            if collection.exists() and published is None:
                raise ScenarioFailed(f"{collection} lists a participant manifest that is missing")

    # -- the invariants --

    async def _check_all(self) -> None:
        self._check_rows()
        await self._check_calls()
        self._verify_checkpoints()
        for source, digest in self.restored_from.items():
            if source.exists() and _tree_digest(source) != digest:
                raise ScenarioFailed(f"{source} was restored from, then modified")
        await self._check_idle()

    def _check_rows(self) -> None:
        rows = list(read_jsonl(self.output))
        keys = Counter((row["_ng_task_index"], row["_ng_rollout_index"]) for row in rows)
        twice = sorted(key for key, count in keys.items() if count > 1)
        if twice or len(keys) != len(self.rollouts):
            raise ScenarioFailed(f"rows: {len(rows)} for {len(self.rollouts)} rollouts; more than one: {twice}")
        rewards = {(row["_ng_task_index"]): row.get("reward") for row in rows}
        expected = {row["_ng_task_index"]: row.get("reward") for row in self.mesh.reference}
        if rewards != expected:
            raise ScenarioFailed(f"rewards differ from the reference: {rewards} != {expected}")
        comparison = compare_rows(self.mesh.reference, rows)
        if not comparison.identical:
            raise ScenarioFailed(f"rows differ from the reference: differing {comparison.differing}, missing "
                                 f"{comparison.missing}, extra {comparison.extra}")

    async def _check_calls(self) -> None:
        await self._count_calls_now()
        made = self.calls_before + self.calls_now
        attempts = self._dispatched()
        bound = sum(self.ref_calls[e.rollout_id] for e in attempts)
        self.ran.append(f"(check) {made} model calls completed, {len(attempts)} attempts dispatched, "
                        f"bound {bound}")
        if made > bound:
            raise ScenarioFailed(f"{made} model calls completed; {len(attempts)} attempts could make {bound}")
        if max(self.ref_calls.values()) <= 2 and made > 2 * len(attempts):
            raise ScenarioFailed(f"{made} model calls > 2 x {len(attempts)} attempts")

    async def _check_idle(self) -> None:
        try:
            held = await self._held()
        except GymError as error:  # a scenario that failed may leave dead processes behind
            held = [error.detail]
        if held:
            raise ScenarioFailed("not idle at the end: " + "; ".join(held))

    async def _held(self) -> list[str]:
        """What any server still holds or does (nothing when idle)."""
        async with Coordinator(self.mesh.launcher.head_url, self.mesh.token) as coordinator:
            statuses = await coordinator.status()
        held = []
        for name, status in statuses.items():
            extras = status["extras"]
            counts = {key: extras.get(key, 0) for key in (
                "episodes", "installed", "sessions", "running", "active_calls", "held_responses",
                "delivering_streams", "ledgers", "in_flight_requests")}
            counts.update(retired_rollouts=status["retired_rollouts"], waiting=status.get("waiting_requests", 0))
            busy = {key: value for key, value in counts.items() if value}
            if status["phase"] != "idle" or busy:
                held.append(f"{name}: phase {status['phase']}, {busy}")
        worker = await self.client.request("GET", self.mesh.launcher.url_of(WORKER) + WORKER_STATUS,
                                           headers=self._auth(), rollout_prefix=False, check=False)
        if worker.status_code == 200 and worker.json()["live_generations"]:
            held.append(f"{WORKER}: live generations {worker.json()['live_generations']}")
        return held


def _tree_digest(directory: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        digest.update(str(path.relative_to(directory)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()
