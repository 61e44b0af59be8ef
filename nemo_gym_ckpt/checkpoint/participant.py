"""The checkpoint participant: phases, fencing, idempotent replies, the lease, admission.

Generic over a ``ParticipantAdapter`` (the kind-specific part). docs/protocol.md section 4:

- one checkpoint id open at a time (another one: ``checkpoint_conflict``); the last 64 ids it
  opened and then closed are fenced (``stale_checkpoint``); a resume of an id it never opened, while
  idle, fences that id too, in a second list of 64 kept apart, so such resumes can never push out
  the fence of an id that was opened;
- every ``deadline_ts`` is at most ``max_deadline_s`` (24 h by default) ahead of the clock, else
  ``invalid_request``, so no call can pause a participant for ever; a resume is never refused
  because its deadline has passed (it is the way out of every open phase);
- prepare, commit and restore are stored with their arguments: the same call again gets the
  stored reply (or awaits the same work), other arguments get ``checkpoint_conflict``;
- one export task and one write task per checkpoint id, started by the first commit and
  outliving its request; a resume before the write's commit point means no manifest, ever;
- the lease expires at ``deadline_ts + lease_grace_seconds``, moved later (never earlier) by each
  call for the open id; then the participant resumes itself and emits ``lease_expired``;
- a commit whose scope names a restart is ``restart_in_scope``; a commit with ``stop`` frees, once
  its write is durable, what the adapter holds outside its records (``StopCommitted``); a failure
  there is logged and never fails the commit;
- data-plane requests wait (``admit``) while a checkpoint is open, and go on after it at most
  ``PER_TURN`` per turn of the event loop (``Pacer``); retired attempts are refused.

All state changes happen in synchronous code between awaits, so no lock is needed; every wait is
bounded by a deadline on the injected clock.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import re
from collections import OrderedDict
from collections.abc import Callable, Coroutine, Hashable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from nemo_gym_ckpt.checkpoint.adapter import BeforeExport, ParticipantAdapter, PauseWindow, Readiness, StopCommitted
from nemo_gym_ckpt.checkpoint.admission import RetireMarks, Signal
from nemo_gym_ckpt.checkpoint.clock import SYSTEM_CLOCK, Clock, wait_until
from nemo_gym_ckpt.checkpoint.collector_pause import CollectorPause
from nemo_gym_ckpt.checkpoint.lease import Lease
from nemo_gym_ckpt.checkpoint.models import (
    CommitRequest,
    ControlRequest,
    ForgetRequest,
    RestoreRequest,
    RetireRequest,
)
from nemo_gym_ckpt.checkpoint.pacer import Pacer
from nemo_gym_ckpt.checkpoint.phases import Op, Phase, advance
from nemo_gym_ckpt.checkpoint.pipeline import ExportPipeline
from nemo_gym_ckpt.checkpoint.records import Record, Scope
from nemo_gym_ckpt.checkpoint.store import CheckpointStore, StopSignal
from nemo_gym_ckpt.checkpoint.telemetry import ATTR, Telemetry
from nemo_gym_ckpt.errors import (
    CheckpointConflict,
    DeadlineExceeded,
    GymError,
    InvalidPhase,
    InvalidRequest,
    RestartInScope,
    RolloutIdRequired,
    StaleCheckpoint,
)
from nemo_gym_ckpt.identity import RolloutIdentity

__all__ = ["DEFAULT_MAX_DEADLINE_S", "INSTANCE_NAME", "KINDS", "REMEMBERED_IDS", "SETTLE_REST_S", "Participant"]

logger = logging.getLogger(__name__)
T = TypeVar("T")

KINDS = ("environment", "model", "agent", "resources")
REMEMBERED_IDS = 64
DEFAULT_MAX_DEADLINE_S = 24 * 3600.0
# What a failing StopCommitted hook may raise: logged, and the stop commit still succeeds.
_STOP_FAILURES = (GymError, OSError, RuntimeError, ValueError, TimeoutError)
READINESS_POLL_S = 1.0
READINESS_GRACE_S = 0.5
"""How long past a prepare's deadline its adapter's readiness may run before the prepare answers
without it (``preparing``, with the last report): an adapter that bounds its own by the deadline, as a
multi-worker server's coordinator does (``worker_hub.READINESS_GRACE_S``), answers with its blockers first."""
SETTLE_REST_S = 0.001
"""The rest before each step of the index made after a resume (a step: ``INDEX_STEP`` records, about
0.3 ms of CPU in process): it takes at most about half a core."""
_DONE = object()
INSTANCE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
"""A participant's instance name (docs/protocol.md section 1): its directory name in a checkpoint."""
Work = Coroutine[Any, Any, dict[str, Any]]


@dataclass
class _Job:
    """One export+write (commit) or read+install (restore), keyed by its arguments. Its callers
    wait on futures of their own that the job's task settles in its last step (``run``): through a
    done callback of the task (``asyncio.shield``) each reply was one turn of the loop later, and on
    a busy server a turn is every callback that was ready when it began."""

    args: Hashable
    waiters: set[asyncio.Future[dict[str, Any]]] = field(default_factory=set)
    task: asyncio.Task[dict[str, Any]] = field(init=False)

    async def run(self, work: Work) -> dict[str, Any]:
        try:
            reply = await work
        except asyncio.CancelledError:
            self._settle(asyncio.Future.cancel)
            raise
        except BaseException as error:
            failure = error  # ``error`` is unbound when the clause ends
            self._settle(lambda waiter: waiter.set_exception(failure))
            raise
        self._settle(lambda waiter: waiter.set_result(reply))
        return reply

    def waiter(self) -> asyncio.Future[dict[str, Any]]:
        """A future of the caller's own, settled like the job (cancelling it leaves the job alone)."""
        waiter: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        if not self.task.done():
            self.waiters.add(waiter)
        elif self.task.cancelled():
            waiter.cancel()
        elif (error := self.task.exception()) is not None:
            waiter.set_exception(error)
        else:
            waiter.set_result(self.task.result())
        return waiter

    def _settle(self, settle: Callable[[asyncio.Future[dict[str, Any]]], Any]) -> None:
        waiters, self.waiters = self.waiters, set()
        for waiter in waiters:
            if not waiter.done():
                settle(waiter)


@dataclass
class _Open:
    """The open checkpoint: at most one at a time."""

    checkpoint_id: str
    lease: Lease
    stop: StopSignal = field(default_factory=StopSignal)
    prepared: dict[str, Any] | None = None
    jobs: dict[Op, _Job] = field(default_factory=dict)
    pipeline: ExportPipeline | None = None
    installing: bool = False
    watchdog: asyncio.Task[None] | None = None


class Participant:
    """One server's side of the checkpoint protocol."""

    def __init__(
        self,
        *,
        kind: str,
        instance: str,
        adapter: ParticipantAdapter,
        store: CheckpointStore,
        lease_grace_s: float,
        clock: Clock = SYSTEM_CLOCK,
        telemetry: Telemetry | None = None,
        max_deadline_s: float = DEFAULT_MAX_DEADLINE_S,
        collector: CollectorPause | None = None,
    ) -> None:
        """``collector``: held off from a checkpoint's opening to its close (``collector_pause.py``)."""
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        if not INSTANCE_NAME.fullmatch(instance):
            raise ValueError(f"instance name {instance!r} is not a safe directory name")
        if lease_grace_s <= 0 or max_deadline_s <= 0:
            raise ValueError("lease_grace_s and max_deadline_s must be > 0")
        self.kind, self.instance, self.adapter, self.store = kind, instance, adapter, store
        self.lease_grace_s, self.clock, self.max_deadline_s = lease_grace_s, clock, max_deadline_s
        self.collector = collector
        self.telemetry = telemetry or Telemetry(kind, instance)
        self.phase = Phase.IDLE
        self.marks = RetireMarks()
        self.signal = Signal()  # readiness may have changed: what a prepare waits on
        self.gate_signal = Signal()  # admission may have changed (open, close, lease, retire): what requests wait on
        self.pacer = Pacer()  # requests that waited go on at most PER_TURN per turn of the loop
        self._open: _Open | None = None
        self._fenced: OrderedDict[str, None] = OrderedDict()  # ids opened here, then closed
        self._fenced_unopened: OrderedDict[str, None] = OrderedDict()  # ids only named by a resume
        self._served = False
        self._installed = False
        self._installing = False
        self._forgotten_while_reading: set[str] = set()
        self._restoring: asyncio.Task[Any] | None = None  # the restore job, running on after a resume
        self._waiting = 0
        self._last_report: dict[str, Any] | None = None
        self._last_commit: dict[str, Any] | None = None
        self._background: set[asyncio.Task[Any]] = set()
        self._gate_watchers: list[Callable[[], None]] = []

    # ---- read-only view ---------------------------------------------------------------------

    @property
    def checkpoint_id(self) -> str | None:
        return self._open.checkpoint_id if self._open else None

    @property
    def fresh(self) -> bool:
        """Has served no rollout traffic and installed nothing: a restore may run."""
        return not (self._served or self._installed or self._installing)

    def status(self) -> dict[str, Any]:
        self._expire_if_due()
        return {
            "kind": self.kind,
            "instance": self.instance,
            "phase": self.phase,
            "checkpoint_id": self.checkpoint_id,
            "lease_expires_at": self._open.lease.expires_at if self._open else None,
            "retired_rollouts": len(self.marks),
            "report": self._last_report,
            "waiting_requests": self._waiting,
            "last_commit": self._last_commit,
            "extras": dict(self.adapter.status_extras()),
        }

    def gate(self) -> dict[str, Any]:
        """What admission follows: the open checkpoint (or ``None``), the phase and the lease's expiry."""
        return {
            "checkpoint_id": self.checkpoint_id,
            "phase": str(self.phase),
            "lease_expires_at": self._open.lease.expires_at if self._open else None,
        }

    def watch_gate(self, watcher: Callable[[], None]) -> None:
        """Call ``watcher`` (synchronously) whenever ``gate()`` changes: a multi-worker server's
        coordinator tells its workers at once, before anything else it sends them."""
        self._gate_watchers.append(watcher)

    def mark_served(self) -> None:
        """Rollout traffic was served elsewhere on this participant's behalf (by one of its workers)."""
        self._served = True

    # ---- control operations -----------------------------------------------------------------

    async def prepare(self, request: ControlRequest) -> dict[str, Any]:
        with self.telemetry.operation(Op.PREPARE, request.checkpoint_id) as span:
            self._check_horizon(request.deadline_ts)
            reply = await self._prepare(request)
            span.set_attribute(ATTR.PHASE, self.phase)
            return reply

    async def renew(self, request: ControlRequest) -> dict[str, Any]:
        with self.telemetry.refusals():  # upstream spans no renew
            self._check_horizon(request.deadline_ts)
            open_ = self._enter(request.checkpoint_id)
            self._check_deadline(request.deadline_ts)
            advance(self.phase, Op.RENEW)
            assert open_ is not None  # every phase renew is allowed in has an open checkpoint
            return {"lease_expires_at": open_.lease.renew(request.deadline_ts)}

    async def commit(self, request: CommitRequest) -> dict[str, Any]:
        with self.telemetry.operation(Op.COMMIT, request.checkpoint_id) as span:
            self._check_horizon(request.deadline_ts)
            reply = await self._commit(request)
            span.set_attribute(ATTR.PHASE, self.phase)
            return reply

    async def restore(self, request: RestoreRequest) -> dict[str, Any]:
        with self.telemetry.operation(Op.RESTORE, request.checkpoint_id) as span:
            self._check_horizon(request.deadline_ts)
            reply = await self._restore(request)
            span.set_attribute(ATTR.PHASE, self.phase)
            return reply

    async def resume(self, request: ControlRequest) -> dict[str, Any]:
        with self.telemetry.operation(Op.RESUME, request.checkpoint_id):
            self._check_horizon(request.deadline_ts)
            return self._resume(request)

    async def retire(self, request: RetireRequest) -> dict[str, Any]:
        with self.telemetry.operation(Op.RETIRE, request.checkpoint_id):
            self._check_horizon(request.deadline_ts)
            episodes = request.episodes() or []
            self._enter_housekeeping(request, Op.RETIRE)
            self.marks.retire(episodes)
            self.signal.notify()
            self.gate_signal.notify()
            await self._after_restore(request.deadline_ts, "retire")
            await self._bounded(self.adapter.retire(episodes), request.deadline_ts, "retire")
            return {"retired": [episode.capture_key for episode in episodes]}

    async def forget(self, request: ForgetRequest) -> dict[str, Any]:
        with self.telemetry.operation(Op.FORGET, request.checkpoint_id):
            self._check_horizon(request.deadline_ts)
            self._enter_housekeeping(request, Op.FORGET)
            self.marks.forget(request.rollout_ids)
            if self._restoring is not None and not self._restoring.done():
                self._forgotten_while_reading.update(request.rollout_ids)
            await self._after_restore(request.deadline_ts, "forget")
            await self._bounded(self.adapter.forget(request.rollout_ids), request.deadline_ts, "forget")
            return {"forgotten": list(request.rollout_ids)}

    # ---- data plane -------------------------------------------------------------------------

    async def admit(self, identity: RolloutIdentity | None, *, deadline_ts: float | None = None) -> None:
        """Let a rollout-scoped request in: wait while a checkpoint is open; refuse retired attempts."""
        if self._open is None and identity is not None and self.phase is Phase.IDLE and self.marks.admits(identity):
            self._served = True  # the hot path: idle, nothing open, not retired (the checks of _admit)
            return
        try:
            await self._admit(identity, deadline_ts)
        except GymError as error:
            self.telemetry.event("refused", code=error.code)
            raise

    async def close_elsewhere(self, identity: RolloutIdentity) -> None:
        """A close of ``identity`` found nothing here; a multi-worker server's other workers drop what
        they hold of its rollout (one process has nothing elsewhere: a no-op)."""

    def notify_changed(self) -> None:
        """Tell waiters that readiness may have changed (an episode parked, a stream drained)."""
        self.signal.notify()

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait (up to ``timeout_s``) until no background work is left; ``True`` if none is.

        Jobs outlive their requests (a write goes on to its end or its stop); this is how a test,
        or a graceful shutdown, waits for them.
        """
        tasks = set(self._background)
        if tasks:
            await asyncio.wait(tasks, timeout=timeout_s)
        return not self._background

    async def aclose(self) -> None:
        """Cancel the background work (jobs, lease watch) and wait for it to end."""
        tasks = list(self._background)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.collector is not None:
            self.collector.release(self)

    # ---- prepare ----------------------------------------------------------------------------

    async def _prepare(self, request: ControlRequest) -> dict[str, Any]:
        open_ = self._enter(request.checkpoint_id)
        if open_ is not None and open_.prepared is not None:
            self._renew(open_, request.deadline_ts)
            return open_.prepared
        self._check_deadline(request.deadline_ts)
        self.phase = advance(self.phase, Op.PREPARE)
        open_ = open_ or self._open_checkpoint(request.checkpoint_id, request.deadline_ts)
        open_.lease.renew(request.deadline_ts)
        with self.telemetry.span("wait_ready", **{ATTR.ID: request.checkpoint_id}):
            return await self._wait_ready(open_, request.deadline_ts)

    async def _wait_ready(self, open_: _Open, deadline_ts: float) -> dict[str, Any]:
        while True:
            changed = self.signal.current
            done, readiness = await wait_until(self.clock, self.adapter.readiness(), deadline_ts + READINESS_GRACE_S)
            self._ensure_current(open_)
            if open_.prepared is not None:
                return open_.prepared
            if not done or readiness is None:  # the deadline came first: as not ready, with the last report
                self.telemetry.event("prepare_not_ready")
                return {"phase": self.phase, "report": self._last_report}
            self._last_report = readiness.report()
            if readiness.ready:
                self.phase = advance(self.phase, Op.READY)
                open_.prepared = {"phase": self.phase, "report": self._last_report}
                if isinstance(self.adapter, PauseWindow):
                    self.adapter.paused(open_.checkpoint_id, open_.lease.expires_at)
                return open_.prepared
            if self.clock.now() >= deadline_ts:
                self.telemetry.event("prepare_not_ready")
                return {"phase": self.phase, "report": self._last_report}
            poll_until = min(deadline_ts, self.clock.now() + READINESS_POLL_S)
            await wait_until(self.clock, changed.wait(), poll_until)

    # ---- commit -----------------------------------------------------------------------------

    async def _commit(self, request: CommitRequest) -> dict[str, Any]:
        open_ = self._enter(request.checkpoint_id)
        directory = self.store.locate(request.checkpoint_dir)
        episodes = request.episodes()
        scope = None if episodes is None else frozenset(episodes)
        args = (directory, scope, request.stop, request.incremental)
        job = self._stored_job(open_, Op.COMMIT, args, request.deadline_ts)
        if job is None:
            self._check_deadline(request.deadline_ts)
            advance(self.phase, Op.COMMIT)
            assert open_ is not None  # commit is only allowed from prepared
            if self.marks:  # no retired rollout: nothing to check
                for episode in episodes or ():
                    self.marks.check(episode)
            open_.lease.renew(request.deadline_ts)
            work = self._run_commit(open_, directory, scope, request.deadline_ts, stop=request.stop,
                                    incremental=request.incremental)
            job = self._start_job(open_, Op.COMMIT, args, work)
        return await self._await_job(job, request.deadline_ts, request.checkpoint_id)

    async def _run_commit(
        self, open_: _Open, directory: Path, scope: Scope | None, deadline_ts: float, *, stop: bool,
        incremental: bool,
    ) -> dict[str, Any]:
        _check_committable(await self.adapter.readiness(), scope)
        if isinstance(self.adapter, BeforeExport):
            await self.adapter.before_export(open_.checkpoint_id, scope, deadline_ts)
        open_writer = functools.partial(self.store.open_writer, directory, self.kind, self.instance, open_.stop,
                                        incremental=incremental)
        open_.pipeline = ExportPipeline(self.adapter, scope, self.telemetry, open_.checkpoint_id)
        with self.telemetry.span("write", **{ATTR.ID: open_.checkpoint_id}) as span:
            manifest, exported = await open_.pipeline.run(open_writer, self.kind, self.instance)
            timings = open_.pipeline.timings
            self.telemetry.moved(Op.COMMIT, span, timings["records"], timings["bytes"])
        self._last_commit = {"checkpoint_id": open_.checkpoint_id, **timings}
        extras = await self.adapter.committed(scope)
        if stop:
            await self._free_after_stop(open_.checkpoint_id, scope, deadline_ts)
        if self._open is open_:
            self.phase = advance(self.phase, Op.COMMIT)
        return {"phase": Phase.COMMITTED, "manifest": manifest.to_json(), "episode_ids": exported, **extras}

    async def _free_after_stop(self, checkpoint_id: str, scope: Scope | None, deadline_ts: float) -> None:
        """A stop commit is durable: let the adapter free what its records do not hold (bounded by the
        commit's deadline; a failure or a timeout is logged and the commit still succeeds)."""
        if not isinstance(self.adapter, StopCommitted):
            return
        try:
            done, _ = await wait_until(self.clock, self.adapter.stop_committed(scope), deadline_ts)
        except _STOP_FAILURES as error:
            logger.warning("checkpoint %s: freeing after the stop commit failed (the commit stands): %s",
                           checkpoint_id, error)
            self.telemetry.event("stop_release_failed", code=getattr(error, "code", type(error).__name__))
            return
        if not done:
            logger.warning("checkpoint %s: freeing after the stop commit ran past the deadline", checkpoint_id)
            self.telemetry.event("stop_release_failed", code=DeadlineExceeded.code)

    # ---- restore ----------------------------------------------------------------------------

    async def _restore(self, request: RestoreRequest) -> dict[str, Any]:
        open_ = self._enter(request.checkpoint_id)
        directory = self.store.locate(request.checkpoint_dir)
        scope = frozenset(request.episodes() or ())
        job = self._stored_job(open_, Op.RESTORE, (directory, scope), request.deadline_ts)
        if job is None:
            self._check_deadline(request.deadline_ts)
            phase = advance(self.phase, Op.RESTORE)
            if not self.fresh:
                raise InvalidPhase("restore expected a fresh process (no rollout traffic, nothing restored), "
                                   "got one that is not")
            for episode in scope:
                self.marks.check(episode.next_attempt())
            self.phase = phase
            open_ = self._open_checkpoint(request.checkpoint_id, request.deadline_ts)
            self._forgotten_while_reading.clear()
            work = self._run_restore(open_, directory, scope)
            job = self._start_job(open_, Op.RESTORE, (directory, scope), work)
            self._restoring = job.task
        return await self._await_job(job, request.deadline_ts, request.checkpoint_id)

    async def _run_restore(self, open_: _Open, directory: Path, scope: Scope) -> dict[str, Any]:
        with self.telemetry.span("read", **{ATTR.ID: open_.checkpoint_id}) as span:
            read = await asyncio.to_thread(self.store.read, directory, self.kind, self.instance, scope)
            self.telemetry.moved(Op.RESTORE, span, len(read.records), read.bytes_read)
        open_.stop.check()
        records = self._still_wanted(read.records)
        open_.installing = self._installing = True  # a resume lets it finish: no second one may begin
        attributes = {ATTR.ID: open_.checkpoint_id, ATTR.RECORDS: len(records)}
        try:
            with self.telemetry.span("install", **attributes):
                await self.adapter.install(records, scope)
        finally:
            self._installing = False
        self._installed = True
        restored = sorted({record.episode.next_attempt().capture_key for record in records})
        source = read.manifest.checkpoint_id
        return {"phase": Phase.RESTORED, "source_checkpoint_id": source, "restored": restored}

    # ---- resume, retire, forget -------------------------------------------------------------

    def _resume(self, request: ControlRequest) -> dict[str, Any]:
        self._expire_if_due()
        if request.checkpoint_id in self._fenced:
            return {"phase": self.phase, "idempotent": True}
        if request.checkpoint_id in self._fenced_unopened:
            return {"phase": self.phase, "idempotent": True}
        open_ = self._enter(request.checkpoint_id)
        if open_ is None:
            self._fence(request.checkpoint_id, opened=False)
            return {"phase": self.phase, "idempotent": True}
        self._close(open_)
        return {"phase": self.phase, "idempotent": False}

    def _enter_housekeeping(self, request: ControlRequest, op: Op) -> None:
        open_ = self._enter(request.checkpoint_id)
        self._check_deadline(request.deadline_ts)
        advance(self.phase, op)
        if open_ is not None:
            open_.lease.renew(request.deadline_ts)

    def _still_wanted(self, records: Sequence[Record]) -> list[Record]:
        """The records read whose rollouts were neither retired nor forgotten while the read ran (the
        install would put them back: a retire or forget does not wait for a restore still reading)."""
        forgotten = self._forgotten_while_reading
        return [record for record in records if self.marks.admits(record.episode.next_attempt())
                and record.episode.rollout_id not in forgotten]

    async def _after_restore(self, deadline_ts: float, what: str) -> None:
        """Wait for a restore that is installing (its install would put back what ``what`` frees). One
        still reading is not waited for: ``_still_wanted`` leaves out what ``what`` freed, and a resume
        stops it."""
        restoring = self._restoring
        if restoring is not None and not restoring.done() and self._installing:
            await self._bounded(asyncio.wait({restoring}), deadline_ts, f"{what} (waiting for the restore installing)")

    async def _bounded(self, work: Coroutine[Any, Any, T], deadline_ts: float, what: str) -> T | None:
        done, result = await wait_until(self.clock, work, deadline_ts)
        if not done:
            raise DeadlineExceeded(f"{what} did not finish by the deadline (the fences are in place)")
        return result

    # ---- admission --------------------------------------------------------------------------

    async def _admit(self, identity: RolloutIdentity | None, deadline_ts: float | None) -> None:
        if identity is None:
            raise RolloutIdRequired("checkpointing is on: a rollout-scoped request needs /ng-rollout/<key>/")
        woken = False
        while True:
            self._check_admissible()
            self._expire_if_due()
            self.marks.check(identity)
            if self.phase is Phase.IDLE:
                if woken:  # woken with every other parked request: go on at the pacer's pace, then
                    woken = False  # look again (a retire or the next checkpoint may have come meanwhile)
                    await self.pacer.turn()
                    continue
                self._served = True
                return
            changed = self.gate_signal.current  # not ``signal``: every park notifies that one
            until = self._open.lease.expires_at if self._open else self.clock.now()
            if deadline_ts is not None:
                self._check_deadline(deadline_ts)
                until = min(until, deadline_ts)
            self._waiting += 1
            try:
                await wait_until(self.clock, changed.wait(), until)
            finally:
                self._waiting -= 1
            woken = True

    # ---- the open checkpoint ----------------------------------------------------------------

    def _enter(self, checkpoint_id: str) -> _Open | None:
        """Fencing common to every op: a resumed id is stale; another open id is a conflict."""
        self._expire_if_due()
        if checkpoint_id in self._fenced or checkpoint_id in self._fenced_unopened:
            raise StaleCheckpoint(f"checkpoint {checkpoint_id} was already resumed")
        open_ = self._open
        if open_ is not None and open_.checkpoint_id != checkpoint_id:
            raise CheckpointConflict(f"checkpoint {open_.checkpoint_id} is open, got {checkpoint_id}")
        return open_

    def _check_horizon(self, deadline_ts: float) -> None:
        """No ``deadline_ts`` may be more than ``max_deadline_s`` ahead: a paused participant always
        comes back (by its lease) within a bounded time."""
        ahead = deadline_ts - self.clock.now()
        if ahead > self.max_deadline_s:
            raise InvalidRequest(f"deadline_ts is {ahead:.0f} s ahead; at most {self.max_deadline_s:.0f} s "
                                 "(checkpoint.max_deadline_seconds) is allowed")

    def _check_deadline(self, deadline_ts: float) -> None:
        late = self.clock.now() - deadline_ts
        if late >= 0:
            raise DeadlineExceeded(f"deadline_ts passed {late:.3f} s ago")

    def _renew(self, open_: _Open, deadline_ts: float) -> None:
        if deadline_ts > self.clock.now():
            open_.lease.renew(deadline_ts)

    def _open_checkpoint(self, checkpoint_id: str, deadline_ts: float) -> _Open:
        open_ = _Open(checkpoint_id, Lease.start(self.clock, self.lease_grace_s, deadline_ts, self._gate_changed))
        self._open = open_
        if self.collector is not None:
            self.collector.hold(self)
        open_.watchdog = self._spawn(open_.lease.watch(lambda: self._expire(open_)))
        self.signal.notify()
        self._gate_changed()
        return open_

    def _gate_changed(self) -> None:
        self.gate_signal.notify()
        for watcher in self._gate_watchers:
            watcher()

    def _ensure_current(self, open_: _Open) -> None:
        if self._open is not open_:
            raise StaleCheckpoint(f"checkpoint {open_.checkpoint_id} was resumed while waiting")

    def _check_admissible(self) -> None:
        """Raise to refuse every request, the parked ones as they wake (a worker that lost its
        coordinator); nothing here."""

    def _expire_if_due(self) -> None:
        if self._open is not None and self._open.lease.expired:
            self._expire(self._open)

    def _expire(self, open_: _Open) -> None:
        if self._open is open_:
            logger.warning("checkpoint %s: lease expired; resuming by itself", open_.checkpoint_id)
            self.telemetry.event("lease_expired")
            self._close(open_)

    def _close(self, open_: _Open) -> None:
        """Resume: stop the write before its commit point (or let a passed one finish), reopen."""
        self._open = None
        if self.collector is not None:
            self.collector.release(self)
        self._fence(open_.checkpoint_id)
        if open_.stop.stop():
            for op, job in open_.jobs.items():
                if not (op is Op.RESTORE and open_.installing):
                    job.task.cancel()
            if open_.pipeline is not None:
                open_.pipeline.cancel_export()
        if open_.watchdog is not None:
            open_.watchdog.cancel()
        self.phase = advance(self.phase, Op.RESUME)
        if isinstance(self.adapter, PauseWindow):
            self.adapter.resumed(open_.checkpoint_id)
        self.signal.notify()
        self._gate_changed()
        if self.store.unsettled:  # the last commit's index, per record: made now, off the pause
            self._spawn(self._settle())

    async def _settle(self) -> None:
        """Make the last commit's index on the event loop, ``INDEX_STEP`` records at a time with a
        rest of ``SETTLE_REST_S`` before each step: no request waits longer than one step, the rest
        of the mesh's resume and the rollouts let go get the cores, and no thread holds the
        interpreter's lock while the loop waits for it (a thread of the lowest priority that does
        stalled its loop 56-113 ms when the cores were busy)."""
        steps = self.store.settle_steps()
        while True:
            await asyncio.sleep(SETTLE_REST_S)
            if next(steps, _DONE) is _DONE:
                return

    def _fence(self, checkpoint_id: str, *, opened: bool = True) -> None:
        """Fence an id: opened ones and ones only named by a resume are remembered apart (64 each)."""
        fences = self._fenced if opened else self._fenced_unopened
        fences[checkpoint_id] = None
        fences.move_to_end(checkpoint_id)
        while len(fences) > REMEMBERED_IDS:
            fences.popitem(last=False)

    # ---- jobs -------------------------------------------------------------------------------

    def _stored_job(self, open_: _Open | None, op: Op, args: Hashable, deadline_ts: float) -> _Job | None:
        job = open_.jobs.get(op) if open_ is not None else None
        if job is None:
            return None
        if job.args != args:
            raise CheckpointConflict(f"{op} of this checkpoint was already asked with other arguments")
        assert open_ is not None
        self._renew(open_, deadline_ts)
        return job

    def _start_job(self, open_: _Open, op: Op, args: Hashable, work: Work) -> _Job:
        job = _Job(args)
        job.task = self._spawn(job.run(work))
        open_.jobs[op] = job
        return job

    async def _await_job(self, job: _Job, deadline_ts: float, checkpoint_id: str) -> dict[str, Any]:
        waiter = job.waiter()
        try:
            done, reply = await wait_until(self.clock, waiter, deadline_ts)
        finally:
            job.waiters.discard(waiter)
        if job.task.cancelled():
            raise StaleCheckpoint(f"checkpoint {checkpoint_id} was resumed before this finished")
        if not done or reply is None:
            raise DeadlineExceeded("still working at the deadline; the same call again awaits the same work")
        return reply

    def _spawn(self, work: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        task = asyncio.create_task(work)
        self._background.add(task)
        task.add_done_callback(self._forget_task)
        return task

    def _forget_task(self, task: asyncio.Task[Any]) -> None:
        self._background.discard(task)
        error = None if task.cancelled() else task.exception()
        if error is not None and not isinstance(error, GymError):
            logger.error("checkpoint background work failed", exc_info=error)


def _check_committable(readiness: Readiness, scope: Scope | None) -> None:
    if not readiness.ready:
        raise InvalidPhase(f"commit expected a ready participant, got {len(readiness.blockers)} blockers "
                           f"({', '.join(readiness.blockers[:5])})")
    if scope is not None and readiness.restarts:
        restarts = {episode.capture_key for episode in scope} & set(readiness.restarts)
        if restarts:
            listed = sorted(restarts)[:10]
            raise RestartInScope(f"restart episodes cannot be in a commit scope: {listed}")
