"""A hypothesis state machine over one participant and its store, on a fake clock.

Random sequences of data-plane requests (some of them restart episodes), prepare, commit (with the
export held or not, with ``stop`` or not, its scope naming the restarts or not), renew (to earlier,
later, past and too far deadlines), resume, resumes of many made-up ids, clock jumps past the lease,
retire, process restarts and restores (of intact or corrupted checkpoints), against a model of the
protocol. Invariants: admission is open whenever idle; the manifest equals the first export; a
checkpoint resumed before its write finished never gets a manifest; restore is all or nothing; no
id is ever reopened. Rules: a renew never shortens the lease (the lease in the model is the latest
expiry asked for; the clock then finds it expiring exactly then); a ``deadline_ts`` further ahead
than the horizon is ``invalid_request``; a commit scope naming a restart is ``restart_in_scope``
(and stays stored as that commit's answer); a stop commit frees (``stop_committed``) once, after its
manifest exists, and a failure there never fails the commit; resumes of ids never opened never push
out the fence of an opened id.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from collections import OrderedDict
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from nemo_gym_ckpt.checkpoint.adapter import ExportItem
from nemo_gym_ckpt.checkpoint.models import CommitRequest, ControlRequest, RestoreRequest, RetireRequest
from nemo_gym_ckpt.checkpoint.participant import DEFAULT_MAX_DEADLINE_S, REMEMBERED_IDS, Participant
from nemo_gym_ckpt.checkpoint.records import Record, Scope
from nemo_gym_ckpt.checkpoint.store import CheckpointStore
from nemo_gym_ckpt.errors import (
    CheckpointConflict,
    DeadlineExceeded,
    GymError,
    InvalidCheckpointState,
    InvalidPhase,
    InvalidRequest,
    RestartInScope,
    StaleAttempt,
    StaleCheckpoint,
)
from nemo_gym_ckpt.identity import RolloutIdentity
from nemo_gym_ckpt.testing.clock import FakeClock
from nemo_gym_ckpt.testing.minimal import SessionsAdapter

pytestmark = pytest.mark.unit

T = TypeVar("T")
GRACE_S = 100.0
IDS = st.sampled_from(["c0", "c1", "c2"])
ROLLOUTS = st.sampled_from(["r0", "r1", "r2"])
ATTEMPTS = st.integers(0, 2)
AHEAD = st.sampled_from([-5.0, 1.0, 10.0, 30.0, 200.0, DEFAULT_MAX_DEADLINE_S + 60])  # renew deadlines, from now


class HeldAdapter(SessionsAdapter):
    """Sessions whose export can be held at a gate (to resume in the middle of a commit)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()
        self.gate.set()
        self.exports = 0
        self.stops: list[bool] = []  # one per stop_committed call: was the commit's manifest there
        self.watch: Path | None = None  # the directory of the commit being made
        self.stop_fails = False

    async def stop_committed(self, scope: Scope | None) -> None:
        assert self.watch is not None
        self.stops.append(any(self.watch.rglob("manifest.json")))
        if self.stop_fails:
            raise OSError("the sandbox is gone already")

    async def export(self, scope: Scope | None) -> AsyncIterator[ExportItem]:
        self.exports += 1
        await self.gate.wait()
        async for item in super().export(scope):
            yield item

    def snapshot(self) -> list[bytes]:
        items = [session.record() for session in self.sessions.values() if not session.restart]
        return [item.raw if isinstance(item, Record) else Record.from_data(item).raw for item in items]


@dataclass(frozen=True)
class CommitArgs:
    directory: str
    scope: tuple[RolloutIdentity, ...] | None
    stop: bool

    def request(self, cid: str, deadline_ts: float) -> CommitRequest:
        episodes = None if self.scope is None else [episode.to_json() for episode in self.scope]
        return CommitRequest(checkpoint_id=cid, deadline_ts=deadline_ts, checkpoint_dir=self.directory,
                             episode_ids=episodes, stop=self.stop)


@dataclass
class Pending:
    checkpoint_id: str
    args: CommitArgs
    task: asyncio.Task[dict[str, Any]]
    snapshot: list[bytes]
    exports: int
    stops: int


@dataclass
class Model:
    """What the protocol says the participant's state is."""

    open_id: str | None = None
    phase: str = "idle"
    fenced: set[str] = field(default_factory=set)  # ids opened here, then closed
    fenced_unopened: OrderedDict[str, None] = field(default_factory=OrderedDict)  # the last 64 named by a resume
    ever_opened: set[str] = field(default_factory=set)
    commit_args: CommitArgs | None = None  # the stored commit of the open checkpoint
    commit_refused: bool = False  # ... which answered restart_in_scope
    marks: dict[str, int] = field(default_factory=dict)
    lease: float = 0.0
    fresh: bool = True

    def retired(self, episode: RolloutIdentity) -> bool:
        return episode.attempt <= self.marks.get(episode.rollout_id, -1)

    def is_fenced(self, cid: str) -> bool:
        return cid in self.fenced or cid in self.fenced_unopened

    def fence_unopened(self, cid: str) -> None:
        self.fenced_unopened[cid] = None
        while len(self.fenced_unopened) > REMEMBERED_IDS:
            self.fenced_unopened.popitem(last=False)

    def renewed(self, expires_at: float) -> None:
        """A renewal moves the lease later, never earlier."""
        self.lease = max(self.lease, expires_at)


class ParticipantMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.root = Path(tempfile.mkdtemp(prefix="ckpt-stateful-"))
        self.clock = FakeClock(start=1_000_000.0)
        self.process = 0
        self.committed: dict[str, list[bytes]] = {}  # directory -> the records of its first export
        self.never_manifest: set[str] = set()
        self.waiting: list[tuple[asyncio.Task[None], RolloutIdentity]] = []
        self.pending: Pending | None = None
        self.steps = 0
        self._new_process()

    # ---- plumbing ---------------------------------------------------------------------------

    def run(self, work: Coroutine[Any, Any, T]) -> T:
        return self.loop.run_until_complete(asyncio.wait_for(work, 10))

    def attempt(self, work: Coroutine[Any, Any, T]) -> T | GymError:
        try:
            return self.run(work)
        except GymError as error:
            return error

    def drain(self) -> None:
        async def turns() -> None:
            for _ in range(50):
                await asyncio.sleep(0)

        self.loop.run_until_complete(turns())

    def _new_process(self) -> None:
        self.process += 1
        self.adapter = HeldAdapter()
        self.participant = Participant(
            kind="environment",
            instance="env",
            adapter=self.adapter,
            store=CheckpointStore(self.root),
            lease_grace_s=GRACE_S,
            clock=self.clock,
        )
        self.model = Model()

    def deadline(self) -> float:
        return self.clock.now() + 30

    def control(self, cid: str) -> ControlRequest:
        return ControlRequest(checkpoint_id=cid, deadline_ts=self.deadline())

    def directory(self, cid: str) -> str:
        return str(self.root / f"p{self.process}-{cid}")

    def expect_refusal(self, outcome: object, cid: str) -> bool:
        """Fencing common to every op; True when the outcome was a refusal the model predicts."""
        if self.model.is_fenced(cid):
            assert isinstance(outcome, StaleCheckpoint), outcome
            return True
        if self.model.open_id not in (None, cid):
            assert isinstance(outcome, CheckpointConflict), outcome
            return True
        return False

    def opened(self, cid: str) -> None:
        assert cid not in self.model.ever_opened or self.model.open_id == cid, f"{cid} was reopened"
        self.model.open_id = cid
        self.model.ever_opened.add(cid)
        self.model.lease = self.deadline() + GRACE_S
        self.model.commit_args, self.model.commit_refused = None, False

    def closed(self) -> None:
        cid = self.model.open_id
        assert cid is not None
        self.model.fenced.add(cid)
        self.model.open_id, self.model.phase = None, "idle"
        self.model.commit_args, self.model.commit_refused = None, False
        if self.pending is not None and self.pending.checkpoint_id == cid:
            self._finish_stopped_commit()

    def _finish_stopped_commit(self) -> None:
        pending, self.pending = self.pending, None
        assert pending is not None
        self.adapter.gate.set()
        outcome = self.attempt(pending.task)
        event(f"a held commit is resumed: {type(outcome).__name__}")
        # The export was held at its gate, so the write cannot have reached its commit point; the
        # request either saw the resume or had already run out of its own deadline.
        assert isinstance(outcome, StaleCheckpoint | DeadlineExceeded), outcome
        self.never_manifest.add(pending.args.directory)
        assert self.run(self.participant.wait_idle(10))

    # ---- rules ------------------------------------------------------------------------------

    @rule(rollout=ROLLOUTS, attempt=ATTEMPTS, value=st.integers(0, 9), restart=st.booleans())
    def request(self, rollout: str, attempt: int, value: int, restart: bool) -> None:
        episode = RolloutIdentity(rollout, attempt)
        task = self.loop.create_task(self.participant.admit(episode))
        self.drain()
        if self.model.retired(episode):
            assert task.done() and isinstance(task.exception(), StaleAttempt)
        elif self.model.phase == "idle":
            assert task.done() and task.exception() is None, "admission is closed while idle"
            self.adapter.put(episode, {"v": value}, restart=restart)
            self.model.fresh = False
        else:
            assert not task.done(), "a request went through while a checkpoint was open"
            self.waiting.append((task, episode))

    @rule(cid=IDS)
    def prepare(self, cid: str) -> None:
        outcome = self.attempt(self.participant.prepare(self.control(cid)))
        if self.expect_refusal(outcome, cid):
            return
        if self.model.phase == "restored":
            assert isinstance(outcome, InvalidPhase), outcome
            return
        assert isinstance(outcome, dict) and outcome["phase"] == "prepared", outcome
        if self.model.open_id is None:
            self.opened(cid)
            self.model.phase = "prepared"
        self.model.renewed(self.deadline() + GRACE_S)

    def commit_args(self, cid: str, stop: bool, name_restarts: bool) -> CommitArgs:
        """A scope naming every session when there are restarts to name; else no scope."""
        episodes = tuple(session.episode for session in self.adapter.sessions.values())
        restarts = any(session.restart for session in self.adapter.sessions.values())
        return CommitArgs(self.directory(cid), episodes if name_restarts and restarts else None, stop)

    @rule(cid=IDS, hold=st.booleans(), stop=st.booleans(), name_restarts=st.booleans(), stop_fails=st.booleans())
    def commit(self, cid: str, hold: bool, stop: bool, name_restarts: bool, stop_fails: bool) -> None:
        if self.pending is not None:
            return
        args = self.commit_args(cid, stop, name_restarts)
        snapshot, exports, stops = self.adapter.snapshot(), self.adapter.exports, len(self.adapter.stops)
        self.adapter.watch, self.adapter.stop_fails = Path(args.directory), stop_fails
        self.adapter.gate.clear() if hold else self.adapter.gate.set()
        task = self.loop.create_task(self.participant.commit(args.request(cid, self.deadline())))
        self.drain()
        if hold and not task.done() and self.model.phase == "prepared" and self.model.commit_args in (None, args):
            # held at the export: past the restart check, so its scope names no restart
            self.pending = Pending(cid, args, task, snapshot, exports, stops)
            self.model.commit_args = args
            self.model.renewed(self.deadline() + GRACE_S)
            return
        self.adapter.gate.set()
        outcome = self.attempt(task)
        if self.expect_refusal(outcome, cid):
            return
        event(f"commit in {self.model.phase}")
        if self.model.commit_args not in (None, args):
            assert isinstance(outcome, CheckpointConflict), outcome
            return
        if self.model.commit_refused or (self.model.phase == "prepared" and args.scope is not None):
            event("a commit scope names a restart")
            assert isinstance(outcome, RestartInScope), outcome  # and the refusal is that commit's answer
            self.model.commit_args, self.model.commit_refused = args, True
        elif self.model.phase == "prepared":
            assert isinstance(outcome, dict) and outcome["phase"] == "committed", outcome
            assert self.adapter.exports == exports + 1
            assert self.adapter.stops[stops:] == ([True] if stop else []), "a stop frees once, after its manifest"
            self.committed[args.directory] = snapshot
            self.model.phase, self.model.commit_args = "committed", args
        elif self.model.phase == "committed":
            assert isinstance(outcome, dict) and self.adapter.exports == exports, "a second export"
            assert len(self.adapter.stops) == stops, "a repeated stop commit freed again"
        else:
            assert isinstance(outcome, InvalidPhase), outcome
            return
        self.model.renewed(self.deadline() + GRACE_S)

    @rule(cid=IDS, hold=st.booleans(), stop=st.booleans(), name_restarts=st.booleans())
    def checkpoint(self, cid: str, hold: bool, stop: bool, name_restarts: bool) -> None:
        """Prepare then commit: the common path, so that deep sequences are frequent."""
        self.prepare(cid)
        self.commit(cid, hold, stop, name_restarts, stop_fails=False)

    @rule(cid=IDS, ahead=AHEAD)
    def renew(self, cid: str, ahead: float) -> None:
        outcome = self.attempt(self.participant.renew(ControlRequest(checkpoint_id=cid,
                                                                     deadline_ts=self.clock.now() + ahead)))
        if ahead > DEFAULT_MAX_DEADLINE_S:
            assert isinstance(outcome, InvalidRequest), outcome  # before anything else: no call pauses for ever
            return
        if self.expect_refusal(outcome, cid):
            return
        if ahead <= 0:
            assert isinstance(outcome, DeadlineExceeded), outcome
            return
        if self.model.open_id is None:
            assert isinstance(outcome, InvalidPhase), outcome
            return
        event("a renew to an earlier expiry" if self.clock.now() + ahead + GRACE_S < self.model.lease else "a renew")
        self.model.renewed(self.clock.now() + ahead + GRACE_S)
        assert outcome == {"lease_expires_at": self.model.lease}, (outcome, self.model.lease)

    @precondition(lambda self: self.pending is not None)
    @rule()
    def release_the_export(self) -> None:
        pending, self.pending = self.pending, None
        assert pending is not None
        retry = self.loop.create_task(self.participant.commit(pending.args.request(pending.checkpoint_id,
                                                                                   self.deadline())))
        self.adapter.gate.set()
        event("a held commit is retried and released")
        first, again = self.attempt(pending.task), self.run(retry)
        assert again["phase"] == "committed" and self.adapter.exports == pending.exports + 1
        assert self.adapter.stops[pending.stops:] == ([True] if pending.args.stop else [])
        if isinstance(first, DeadlineExceeded):  # time passed its deadline: the work went on
            event("the first commit request ran out of time; its retry got the same work")
        else:
            assert first == again
        self.committed[pending.args.directory] = pending.snapshot
        self.model.phase = "committed"
        self.model.renewed(self.deadline() + GRACE_S)

    @rule(cid=IDS)
    def resume(self, cid: str) -> None:
        outcome = self.attempt(self.participant.resume(self.control(cid)))
        if self.model.is_fenced(cid):
            assert isinstance(outcome, dict) and outcome["idempotent"] is True, outcome
            return
        if self.model.open_id not in (None, cid):
            assert isinstance(outcome, CheckpointConflict), outcome
            return
        assert isinstance(outcome, dict) and outcome["idempotent"] is (self.model.open_id is None), outcome
        if self.model.open_id is None:
            self.model.fence_unopened(cid)
        else:
            self.closed()

    @rule(count=st.sampled_from([1, REMEMBERED_IDS + 1]), late=st.booleans())
    def resume_made_up_ids(self, count: int, late: bool) -> None:
        """Resumes of ids never opened (a past deadline or not): fenced apart, they never evict the
        fence of an id that was opened (probed with a renew, which is stale only for fenced ids)."""
        for _ in range(count):
            self.steps += 1
            made_up = f"u{self.steps}"
            deadline = self.clock.now() - 5 if late else self.deadline()
            outcome = self.attempt(self.participant.resume(ControlRequest(checkpoint_id=made_up,
                                                                          deadline_ts=deadline)))
            if self.model.open_id is not None:
                assert isinstance(outcome, CheckpointConflict), outcome
                continue
            assert outcome == {"phase": "idle", "idempotent": True}, outcome  # never refused for its deadline
            self.model.fence_unopened(made_up)
        for cid in sorted(self.model.fenced):
            probe = self.attempt(self.participant.renew(self.control(cid)))
            assert isinstance(probe, StaleCheckpoint), f"the fence of {cid} was pushed out: {probe}"

    @rule(seconds=st.sampled_from([1.0, 30.0, 30.0, 150.0]))
    def time_passes(self, seconds: float) -> None:
        self.clock.advance(seconds)
        self.drain()
        status = self.participant.status()
        if self.model.open_id is not None and self.clock.now() >= self.model.lease:
            event("the lease expires")
            self.closed()
        assert status["phase"] == self.model.phase and status["checkpoint_id"] == self.model.open_id

    @rule(rollout=ROLLOUTS, attempt=ATTEMPTS)
    def retire(self, rollout: str, attempt: int) -> None:
        cid = self.model.open_id or f"h{self.steps}"
        self.steps += 1
        request = RetireRequest(
            checkpoint_id=cid,
            deadline_ts=self.deadline(),
            episode_ids=[{"rollout_id": rollout, "attempt": attempt}],
        )
        outcome = self.attempt(self.participant.retire(request))
        if self.model.phase not in ("idle", "restored"):
            assert isinstance(outcome, InvalidPhase), outcome
            return
        assert outcome == {"retired": [RolloutIdentity(rollout, attempt).capture_key]}, outcome
        self.model.marks[rollout] = max(attempt, self.model.marks.get(rollout, -1))
        if self.model.open_id is not None:
            self.model.renewed(self.deadline() + GRACE_S)

    @precondition(lambda self: self.pending is None)
    @rule()
    def new_process(self) -> None:
        for task, _ in self.waiting:
            task.cancel()
        self.drain()
        self.waiting.clear()
        self.run(self.participant.aclose())
        self._new_process()

    @precondition(lambda self: bool(self.committed))
    @rule(cid=IDS, data=st.data(), corrupt=st.booleans())
    def restore(self, cid: str, data: st.DataObject, corrupt: bool) -> None:
        source = data.draw(st.sampled_from(sorted(self.committed)))
        records = [Record.from_raw(raw) for raw in self.committed[source]]
        chosen = data.draw(
            st.lists(st.sampled_from([r.episode for r in records] + [RolloutIdentity("zz")]), unique=True)
        )
        directory = self._corrupted_copy(source) if corrupt else source
        before = dict(self.adapter.sessions)
        outcome = self.attempt(
            self.participant.restore(
                RestoreRequest(
                    checkpoint_id=cid,
                    deadline_ts=self.deadline(),
                    checkpoint_dir=directory,
                    episode_ids=[e.to_json() for e in chosen],
                )
            )
        )
        if self.expect_refusal(outcome, cid):
            return
        if self.model.phase == "restored" and self.model.open_id == cid:  # a retry: stored, or a conflict
            assert self.adapter.sessions == before, "a second install"
            return
        if self.model.phase != "idle" or not self.model.fresh:
            assert isinstance(outcome, InvalidPhase), outcome
            return
        if any(self.model.retired(e.next_attempt()) for e in chosen):
            assert isinstance(outcome, StaleAttempt), outcome
            return
        event(f"restore of {'a corrupted' if corrupt and records else 'an intact'} checkpoint")
        self.opened(cid)
        self.model.phase = "restored"
        self._check_all_or_nothing(outcome, before, records, chosen, corrupt and bool(records))

    @precondition(lambda self: bool(self.committed) and self.pending is None)
    @rule(cid=IDS, data=st.data(), corrupt=st.booleans())
    def crash_and_restore(self, cid: str, data: st.DataObject, corrupt: bool) -> None:
        """The common path after a crash: a fresh process restores a checkpoint."""
        self.new_process()
        self.restore(cid, data, corrupt)

    def _check_all_or_nothing(
        self,
        outcome: object,
        before: dict[str, Any],
        records: list[Record],
        chosen: list[RolloutIdentity],
        corrupt: bool,
    ) -> None:
        if corrupt:
            assert isinstance(outcome, InvalidCheckpointState), outcome
            assert self.adapter.sessions == before, "a refused restore installed something"
            return
        assert isinstance(outcome, dict), outcome
        expected = {r.episode.next_attempt().capture_key: r for r in records if r.episode in chosen}
        assert sorted(outcome["restored"]) == sorted(expected)
        assert set(self.adapter.sessions) == set(before) | set(expected)
        for key, record in expected.items():
            assert self.adapter.sessions[key].restored == record
        self.model.fresh = False

    def _corrupted_copy(self, source: str) -> str:
        copy = f"{source}-bad{self.steps}"
        self.steps += 1
        shutil.copytree(source, copy)
        records = next(Path(copy).rglob("records-*.jsonl"))
        content = bytearray(records.read_bytes())
        if content:
            content[len(content) // 2] ^= 0x20
        records.write_bytes(bytes(content))
        return copy

    # ---- invariants -------------------------------------------------------------------------

    @invariant()
    def admission_is_open_whenever_idle(self) -> None:
        self.drain()
        status = self.participant.status()
        assert status["phase"] == self.model.phase, (status, self.model)
        if self.model.phase != "idle":
            return
        for task, episode in self.waiting:
            assert task.done(), "a request still waits while the participant is idle"
            if task.exception() is None:
                self.model.fresh = False
            else:
                assert isinstance(task.exception(), StaleAttempt) and self.model.retired(episode)
        self.waiting.clear()
        assert status["waiting_requests"] == 0

    @invariant()
    def manifests_equal_the_first_export(self) -> None:
        for directory, snapshot in self.committed.items():
            where = Path(directory) / "gym" / "environment" / "env"
            records = next(where.glob("records-*.jsonl"))
            assert (where / "manifest.json").exists()
            assert records.read_bytes().splitlines() == snapshot

    @invariant()
    def a_checkpoint_resumed_before_its_write_finished_never_gets_a_manifest(self) -> None:
        for directory in self.never_manifest:
            assert not list(Path(directory).rglob("manifest.json")), directory

    def teardown(self) -> None:
        if self.pending is not None:
            self.adapter.gate.set()
            self.attempt(self.pending.task)
        for task, _ in self.waiting:
            task.cancel()
        self.loop.run_until_complete(self.participant.aclose())
        self.drain()
        self.loop.run_until_complete(self.loop.shutdown_default_executor())
        self.loop.close()
        shutil.rmtree(self.root, ignore_errors=True)


ParticipantMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    derandomize=True,
)
TestParticipantMachine = ParticipantMachine.TestCase
