"""The environment server's side of a checkpoint: ``EpisodesAdapter`` (docs/protocol.md section 7).

``mount_environment`` (``nemo_gym_ckpt.environment.base``) mounts one over the server's ``Program`` when
checkpointing is on; with it off nothing here runs. The adapter is also the ``EpisodeHooks`` of
every episode it runs, which is how it parks them.

Each ``/run`` is one live episode (``LiveEpisode``), keyed by its capture key, running as its own
task:

- **admission**: a ``/run`` needs a rollout identity (``rollout_id_required``), waits while a
  checkpoint is open and is refused for a retired attempt (``stale_attempt``);
- **parking**: before each step and at each boundary (the last one too, so a finished episode's
  reply waits as well), an episode finding a checkpoint open waits there until resume;
- **budget**: an episode's timeout is charged on ``CheckpointFreeClock``, the participant's clock
  standing still while a checkpoint is open (prepare or restore until resume or lease expiry), so
  neither parking nor a ``replay`` step waiting on a parked agent or model uses it up;
- **readiness**: every live episode parked at a boundary, between steps, inside a ``replay`` step,
  or a restart; an episode inside a ``wait`` step blocks. Kept as the episodes move
  (``ReadinessTally``: each episode tells it when its step's mode changes or it is marked a restart),
  so a prepare or a commit asks without walking the episodes;
- **restarts** (``Episode.restart``, marked by a step from the seed reply's or the agent's
  ``x-ng-checkpoint-restart: 1``) never park, never block and are never exported;
- **export**: ``{episode_id, task_digest, boundary}`` per live, continuable episode: its last
  boundary (``null`` before the first step completed: start over, keeping the lineage). Each
  boundary's record is encoded once, when the episode reaches it (before and after every step), so
  a commit's capture is a lookup per episode, also the first commit after a burst of starts, in one
  loop (``export_at_once``);
- **restore**: each record is checked (fields, digest, boundary, its next step in the program, its
  state writable in a record again and holding what the steps from its next step on read:
  ``Program.check_state``) and installed, all or nothing, as an ``Installed`` boundary of the next
  attempt. The controller's ``/run`` of that attempt with the same task row continues from it
  (another row: ``invalid_checkpoint_state``). Until then, and while the episode has not moved past it, the
  record it came from is exported again byte for byte;
- **retire**: cancels the attempts' tasks (their ``/run`` answers ``stale_attempt``), waits for
  their cleanup to end and frees them; installed boundaries of those attempts are dropped.
  **forget** does the same for whole rollouts.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from nemo_gym_ckpt.checkpoint.adapter import ExportItem, Readiness
from nemo_gym_ckpt.checkpoint.clock import wait_until
from nemo_gym_ckpt.checkpoint.participant import Participant
from nemo_gym_ckpt.checkpoint.records import Record, Scope
from nemo_gym_ckpt.environment.episode import Boundary, Episode, Program, Step, StepBudget, run_episode, task_digest
from nemo_gym_ckpt.environment.tally import ReadinessTally
from nemo_gym_ckpt.errors import InvalidCheckpointState, InvalidPhase, InvalidRequest, StaleAttempt
from nemo_gym_ckpt.identity import RolloutIdentity

__all__ = [
    "RECORD_KEYS",
    "RECORD_LEVELS",
    "CheckpointFreeClock",
    "EpisodesAdapter",
    "Installed",
    "LiveEpisode",
    "RunLimits",
    "stopped_or_result",
]

RECORD_KEYS = frozenset({"episode_id", "task_digest", "boundary"})
RECORD_LEVELS = 2
"""Levels a record wraps a boundary's state in: ``{"boundary": {"state": ...}}``."""
_DIGEST = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class RunLimits:
    """The timeouts of each episode (the environment's settings)."""

    episode_timeout_s: float | None
    cleanup_timeout_s: float


class CheckpointFreeClock:
    """The participant's clock, standing still while it has a checkpoint open: an episode's budget.

    ``now()`` is the participant clock's time minus every interval during which a checkpoint was
    open (from its prepare or restore to its resume or lease expiry). While anything sleeps on it,
    one listener task follows the participant's change signal (notified at every open and close)
    and notes each transition when it happens, so an episode starting or ending wakes one task, not
    every running step. Budgets only compare two readings taken inside one step, during which the
    step's timeout sleeps here: no transition inside a step goes unnoticed. Without sleepers a
    transition is noted when ``now`` is next read.

    A sleeper with no checkpoint open sleeps on the participant's clock to the time its deadline
    would come if none opened, then reads ``now`` again: a checkpoint opened meanwhile (noted by the
    listener) has moved the deadline later, never earlier, so waking then and sleeping on is exact,
    and the step's watchdog costs one plain sleep rather than a race against the transition. Only
    while a checkpoint is open does a sleeper wait for the transition (its close).
    """

    RECHECK_S = 60.0
    """Longest wait of a sleeper or the listener before it looks again (their deadline)."""

    def __init__(self, participant: Participant) -> None:
        self.participant = participant
        self._closed_s = 0.0
        self._open_since: float | None = None
        self._transition = asyncio.Event()
        self._sleepers = 0
        self._listener: asyncio.Task[None] | None = None

    @property
    def paused(self) -> bool:
        """A checkpoint was open when last looked at."""
        return self._open_since is not None

    def now(self) -> float:
        base = self._observe()
        frozen = self._closed_s + (base - self._open_since if self._open_since is not None else 0.0)
        return base - frozen

    def _observe(self) -> float:
        base = self.participant.clock.now()
        is_open = self.participant.checkpoint_id is not None
        if is_open == (self._open_since is not None):
            return base
        if is_open:
            self._open_since = base
        else:
            assert self._open_since is not None
            self._closed_s += base - self._open_since
            self._open_since = None
        event, self._transition = self._transition, asyncio.Event()
        event.set()
        return base

    async def sleep_until(self, ts: float) -> None:
        """Until ``now()`` reaches ``ts``: sleep on the clock; stand still while a checkpoint is open."""
        clock = self.participant.clock
        self._sleepers += 1
        if self._listener is None:
            self._listener = asyncio.create_task(self._listen())
        try:
            while True:
                transition = self._transition
                charged = self.now()
                if self.paused:
                    await wait_until(clock, transition.wait(), clock.now() + self.RECHECK_S)
                elif charged >= ts:
                    return
                else:
                    await clock.sleep_until(clock.now() + min(ts - charged, self.RECHECK_S))
        finally:
            self._sleepers -= 1
            if not self._sleepers and self._listener is not None:
                self._listener.cancel()
                self._listener = None

    async def _listen(self) -> None:
        """Note every open and close while someone sleeps (a lease running out included)."""
        participant = self.participant
        while True:
            changed = participant.gate_signal.current
            self._observe()
            until = participant.clock.now() + self.RECHECK_S
            if self.paused:  # wake at the lease's end: status() resumes a participant whose lease ran out
                expires = participant.status()["lease_expires_at"]
                until = min(until, expires) if expires is not None else participant.clock.now()
            await wait_until(participant.clock, changed.wait(), until)


@dataclass(frozen=True)
class Installed:
    """A restored boundary waiting for the ``/run`` of its attempt."""

    identity: RolloutIdentity
    task_digest: str
    boundary: Boundary | None
    record: Record

    def record_for(self, scope: Scope | None) -> ExportItem | None:
        """The record it came from (byte for byte), or a fresh one of its own attempt in scope."""
        if scope is None or self.record.episode in scope:
            return self.record
        if self.identity in scope:
            return {"episode_id": self.identity.to_json(), "task_digest": self.task_digest,
                    "boundary": self.record.data["boundary"]}
        return None


@dataclass(eq=False)
class LiveEpisode:
    """One ``/run`` in progress: its episode, its task, whether it is parked now."""

    episode: Episode
    task: asyncio.Task[dict[str, Any]] | None = None
    parked: bool = False
    restored: Record | None = None
    restored_boundary: Boundary | None = None
    _encoded: tuple[Boundary, Record] | None = None  # the record of the boundary it was last built at

    @property
    def key(self) -> str:
        return self.episode.identity.capture_key

    def unchanged_record(self) -> Record | None:
        """The record it was restored from while it still stands at that boundary."""
        if self.restored is not None and self.episode.boundary is self.restored_boundary:
            return self.restored
        return None

    def record_for(self, scope: Scope | None) -> Record | None:
        unchanged = self.unchanged_record()
        if unchanged is not None and (scope is None or unchanged.episode in scope):
            return unchanged
        if scope is None or self.episode.identity in scope:
            return self.encoded()
        return None

    def encoded(self) -> Record:
        """The episode's record, built once per boundary (boundaries never change: a commit of an
        episode that did not move costs a lookup, and its bytes are the previous commit's)."""
        boundary = self.episode.boundary
        if self._encoded is None or self._encoded[0] is not boundary:
            self._encoded = (boundary, Record.from_data(self.episode.record()))
        return self._encoded[1]


def stopped_or_result(task: asyncio.Task[dict[str, Any]], key: str) -> dict[str, Any]:
    """The final state of a finished episode task; ``StaleAttempt`` if it was stopped (retired)."""
    if task.cancelled():
        raise StaleAttempt(f"episode {key} was retired while it ran")
    return task.result()


class EpisodesAdapter:
    """A ``ParticipantAdapter`` (and the ``EpisodeHooks``) over the live episodes of one program."""

    def __init__(self, program: Program, limits: RunLimits) -> None:
        self.program = program
        self.limits = limits
        self.participant: Participant | None = None
        self.live: dict[str, LiveEpisode] = {}
        self.installed: dict[str, Installed] = {}
        self.tally = ReadinessTally()
        self._at_hand: dict[str, Record] = {}
        """The record of each live episode encoded at the boundary it stands at, by capture key: set
        as the episode reaches it (``_hold``), dropped when it leaves or is marked a restart. An
        episode standing at its restored record is not here, nor one that has not reached a boundary
        yet; when every live episode but the restarts is, a commit takes these whole."""
        self._budget_clock: CheckpointFreeClock | None = None

    @property
    def budget_clock(self) -> CheckpointFreeClock:
        """The clock every episode's budget runs on (built once the participant is mounted)."""
        if self._budget_clock is None:
            self._budget_clock = CheckpointFreeClock(self._participant())
        return self._budget_clock

    # ---- data plane -------------------------------------------------------------------------

    async def run(self, identity: RolloutIdentity | None, task: dict[str, Any]) -> dict[str, Any]:
        """One ``/run``: admitted, started (or continued from an installed boundary), awaited."""
        participant = self._participant()
        await participant.admit(identity)
        assert identity is not None  # admit refuses a request without one
        live = self._start(identity, task)
        live.task = asyncio.create_task(self._drive(live))
        return await self._outcome(live.task, live.key)

    def _start(self, identity: RolloutIdentity, task: dict[str, Any]) -> LiveEpisode:
        key = identity.capture_key
        if key in self.live:
            raise InvalidRequest(f"episode {key} is already running; retire it and dispatch the next attempt")
        installed = self.installed.get(key)
        if installed is None:
            live = LiveEpisode(Episode.start(identity, task, self.program))
        else:
            live = self._continue(installed, task)
            del self.installed[key]
        self.live[key] = live
        live.episode.watcher = self._watch
        self.tally.moved(key, live.episode)
        return live

    def _watch(self, episode: Episode) -> None:
        """An episode's step mode or restart mark changed: keep the tally (live episodes only)."""
        key = episode.identity.capture_key
        live = self.live.get(key)
        if live is not None and live.episode is episode:
            self.tally.moved(key, episode)
            if episode.restart:
                self._at_hand.pop(key, None)

    def _continue(self, installed: Installed, task: dict[str, Any]) -> LiveEpisode:
        digest = task_digest(task)
        if digest != installed.task_digest:
            raise InvalidCheckpointState(
                f"episode {installed.identity.capture_key}: the task row's digest {digest[:12]} differs "
                f"from the checkpointed {installed.task_digest[:12]}")
        identity, boundary = installed.identity, installed.boundary
        if boundary is None:
            episode = Episode.start(identity, task, self.program)
        else:
            episode = Episode.from_boundary(identity, task, boundary, self.program)
        return LiveEpisode(episode, restored=installed.record, restored_boundary=episode.boundary)

    async def _drive(self, live: LiveEpisode) -> dict[str, Any]:
        try:
            return await run_episode(
                self.program, live.episode, hooks=self,
                budget=StepBudget(self.limits.episode_timeout_s, clock=self.budget_clock),
                cleanup_timeout_s=self.limits.cleanup_timeout_s, record_levels=RECORD_LEVELS,
            )
        finally:
            if self.live.get(live.key) is live:
                del self.live[live.key]
                self._at_hand.pop(live.key, None)
                self.tally.left(live.key)
            live.episode.watcher = None
            self._participant().notify_changed()

    @staticmethod
    async def _outcome(task: asyncio.Task[dict[str, Any]], key: str) -> dict[str, Any]:
        """Await the episode; a ``/run`` whose own request is cancelled stops its episode too."""
        try:
            await asyncio.wait({task})
        except asyncio.CancelledError:
            task.cancel()
            raise
        return stopped_or_result(task, key)

    # ---- episode hooks: parking -------------------------------------------------------------

    async def entering(self, episode: Episode, step: Step) -> None:
        await self._hold(episode)

    async def at_boundary(self, episode: Episode) -> None:
        await self._hold(episode)

    async def _hold(self, episode: Episode) -> None:
        """Encode the record of this boundary now, on the data plane, so that a commit only looks
        it up; then park here while a checkpoint is open (restarts never park, nor are exported)."""
        participant = self._participant()
        key = episode.identity.capture_key
        live = self.live.get(key)
        if live is None or episode.restart:
            return
        if live.unchanged_record() is None:
            self._at_hand[key] = live.encoded()
        if participant.checkpoint_id is None:
            return
        live.parked = True
        self.tally.parked += 1
        participant.notify_changed()
        try:
            await participant.admit(episode.identity)
        finally:
            live.parked = False
            self.tally.parked -= 1

    # ---- prepare ----------------------------------------------------------------------------

    async def readiness(self) -> Readiness:
        return self._survey(with_lists=True)

    def _counts(self) -> dict[str, int]:
        return dict(self._survey(with_lists=False).counts)

    def _survey(self, *, with_lists: bool) -> Readiness:
        """Blockers, restarts and counts, from the tally kept as episodes move (no walk over them)."""
        return self.tally.readiness(len(self.live), len(self.installed), with_lists=with_lists)

    # ---- commit -----------------------------------------------------------------------------

    async def export(self, scope: Scope | None) -> AsyncIterator[ExportItem]:
        for installed in list(self.installed.values()):
            item = installed.record_for(scope)
            if item is not None:
                yield item
        for record in self._live_records(scope):
            yield record

    def export_at_once(self, scope: Scope | None) -> list[Record] | None:
        """``export`` in one list while no restored boundary waits for its ``/run`` (``None`` then):
        the records at hand when every live episode but the restarts has one (the pipeline keeps
        those in scope), else each live episode's record looked up in turn."""
        if self.installed:
            return None
        if self._all_at_hand():
            return list(self._at_hand.values())
        return self._live_records(scope)

    def _live_records(self, scope: Scope | None) -> list[Record]:
        records: list[Record] = []
        for live in self.live.values():
            record = None if live.episode.restart else live.record_for(scope)
            if record is not None:
                records.append(record)
        return records

    async def committed(self, scope: Scope | None) -> Mapping[str, Any]:
        """Drop restored boundaries (and forget restored records) that this commit's scope left out."""
        if scope is not None:
            for key, installed in list(self.installed.items()):
                if installed.record.episode not in scope and installed.identity not in scope:
                    del self.installed[key]
            if self._all_at_hand():  # no episode stands at its restored record (a restart may: never exported)
                return {}
            for live in self.live.values():
                unchanged = live.unchanged_record()
                if unchanged is not None and unchanged.episode not in scope:
                    live.restored = None
        return {}

    def _all_at_hand(self) -> bool:
        """Every live episode but the restarts has its record at hand (none stands at a restored
        record, none has yet to reach its first boundary)."""
        return len(self._at_hand) + len(self.tally.restarts) == len(self.live)

    # ---- restore ----------------------------------------------------------------------------

    async def install(self, records: Sequence[Record], scope: Scope) -> None:
        if self.live or self.installed:
            raise InvalidPhase("restore expected an environment with no episodes, got one with some")
        planned: dict[str, Installed] = {}
        for record in records:
            installed = self._plan(record)
            key = installed.identity.capture_key
            if key in planned:
                raise InvalidCheckpointState(f"episode {record.episode.capture_key} has more than one record")
            planned[key] = installed
        self.installed.update(planned)

    def _plan(self, record: Record) -> Installed:
        key = record.episode.capture_key
        data = record.data
        if set(data) != RECORD_KEYS:
            raise InvalidCheckpointState(f"record of {key}: expected the fields {sorted(RECORD_KEYS)}, "
                                         f"got {sorted(data)}")
        digest = data["task_digest"]
        if not isinstance(digest, str) or not _DIGEST.fullmatch(digest):
            raise InvalidCheckpointState(f"record of {key}: task_digest is not a SHA-256 hex digest")
        boundary = None if data["boundary"] is None else self._boundary_of(key, data["boundary"])
        return Installed(record.episode.next_attempt(), digest, boundary, record)

    def _boundary_of(self, key: str, data: Any) -> Boundary:
        """A record's boundary, if the program can go on from it (``InvalidCheckpointState`` naming
        the record otherwise): well formed, its state writable in a record again, its next step one
        of the program's, and its state holding what the steps from there on read."""
        try:
            boundary = Boundary.from_json(data, RECORD_LEVELS)
        except InvalidCheckpointState as error:
            raise InvalidCheckpointState(f"record of {key}: {error.detail}") from None
        steps = self.program.steps
        if boundary.next_step is not None and boundary.next_step not in steps:
            raise InvalidCheckpointState(f"record of {key}: boundary names step {boundary.next_step!r}, "
                                         f"not one of {list(self.program.steps)}")
        try:
            self.program.check_state(boundary.next_step, data["state"])
        except (ValueError, TypeError) as error:
            raise InvalidCheckpointState(f"record of {key}: the state of its boundary (next step "
                                         f"{boundary.next_step!r}) does not fit this program: {error}") from None
        return boundary

    # ---- retire, forget ---------------------------------------------------------------------

    async def retire(self, episodes: Sequence[RolloutIdentity]) -> None:
        marks: dict[str, int] = {}
        for episode in episodes:
            marks[episode.rollout_id] = max(episode.attempt, marks.get(episode.rollout_id, -1))
        await self._stop_where(lambda identity: identity.attempt <= marks.get(identity.rollout_id, -1))

    async def forget(self, rollout_ids: Sequence[str]) -> None:
        gone = set(rollout_ids)
        await self._stop_where(lambda identity: identity.rollout_id in gone)

    async def _stop_where(self, condition: Callable[[RolloutIdentity], bool]) -> None:
        """Drop matching installed boundaries; cancel matching episodes and wait for their cleanup."""
        for key, installed in list(self.installed.items()):
            if condition(installed.identity):
                del self.installed[key]
        tasks = [live.task for live in self.live.values()
                 if live.task is not None and condition(live.episode.identity)]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)

    # ---- status -----------------------------------------------------------------------------

    def status_extras(self) -> Mapping[str, Any]:
        return self._counts()

    def _participant(self) -> Participant:
        assert self.participant is not None, "the adapter is used only once mounted"
        return self.participant

