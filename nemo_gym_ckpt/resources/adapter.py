"""The resources server's side of a checkpoint: ``ResourcesAdapter`` (docs/protocol.md section 7).

``ResourcesServer.build_app`` mounts one over the server when checkpointing is on; with it off
nothing here runs. What it does, by the server's ``checkpoint_mode``:

- ``stateless``: a session is membership only. Each record is ``{episode_id, session_id}``; a
  restore puts back empty sessions under the same ids, so the cookies the environment kept still
  work.
- ``exported``: each record is ``{episode_id, session_id, state}``, the state being what the
  server's ``export_session`` hook answers. At prepare each idle session is parked once
  (``park_session``); a restore checks each state with ``restore_session`` before it installs
  anything.
- ``restart_only``: never exported. Its sessions are listed as ``restarts`` and never block a
  prepare; it never closes admission: new seeds and calls on existing sessions keep running while
  a checkpoint is open (a checkpoint has nothing of theirs to wait for).

A commit sent with ``stop: true`` (the controller stops the mesh next) calls, once its write is
durable, the server's ``release_session`` on every session (in any mode): what a session holds
outside its JSON state (a child process, a sandbox) is freed. A failing release is logged and the
others still run; the commit never fails for it.

Data-plane requests go through ``admitted(route, identity)``: it waits while a checkpoint is open (a
restart-only server's calls on existing sessions only check the retire marks), refuses retired
attempts with ``stale_attempt`` and counts the request in flight. In-flight tool calls and, when the
server declares ``checkpoint_verify = "wait"``, in-flight verifies block a prepare; a ``replay``
verify never does (after a crash it simply runs again).

Retire frees a session only once its requests in flight have stopped: the participant fences the
attempts first (their new requests are refused), the adapter waits until none of their requests is
in flight, and only then drops the sessions (``retire_session`` included). While they wait, those
sessions are readiness blockers and are never exported.

A restored session keeps the ``Record`` it came from until a call touches it, and is exported
again byte for byte while it is untouched (as its new attempt when only that attempt is in scope).
Restore installs every record under ``episode.next_attempt()``, bound to that attempt, or nothing.
A ``/seed_session`` of an attempt that still holds restored, untouched sessions replaces them (they
are dropped, ``retire_session`` included): that attempt's environment is seeding again because its
record had no boundary past its seed (``boundary: null``, the episode starts over), so nothing
holds their cookies (this assumes an environment seeds one session per episode on a resources server).
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, cast

from nemo_gym_ckpt.checkpoint.adapter import ExportItem, Readiness
from nemo_gym_ckpt.checkpoint.participant import Participant
from nemo_gym_ckpt.checkpoint.records import Record, Scope
from nemo_gym_ckpt.errors import GymError, InvalidCheckpointState, InvalidPhase, RolloutIdRequired
from nemo_gym_ckpt.identity import RolloutIdentity
from nemo_gym_ckpt.resources.sessions import Session, SessionTable

__all__ = [
    "CHECKPOINT_MODES",
    "CHECKPOINT_VERIFY_MODES",
    "SESSION_ID",
    "CheckpointMode",
    "CheckpointVerify",
    "ResourcesAdapter",
    "Route",
    "SessionHost",
]

Route = Literal["seed", "tool", "verify", "close"]
CheckpointMode = Literal["stateless", "exported", "restart_only"]
CheckpointVerify = Literal["wait", "replay"]
CHECKPOINT_MODES: tuple[str, ...] = ("stateless", "exported", "restart_only")
CHECKPOINT_VERIFY_MODES: tuple[str, ...] = ("wait", "replay")
SESSION_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")
logger = logging.getLogger(__name__)


class SessionHost(Protocol):
    """What the adapter needs of a resources server: its declaration, its sessions and their hooks."""

    @property
    def checkpoint_mode(self) -> CheckpointMode: ...

    @property
    def checkpoint_verify(self) -> CheckpointVerify: ...

    @property
    def sessions(self) -> SessionTable: ...

    async def export_session(self, session: Session) -> dict[str, Any]: ...

    async def restore_session(self, state: Any) -> dict[str, Any]: ...

    async def park_session(self, session: Session) -> None: ...

    async def release_session(self, session: Session) -> None: ...

    async def drop_session(self, session_id: str | None) -> bool: ...


@dataclass(frozen=True)
class _Planned:
    """One checked record, ready to install."""

    session_id: str
    identity: RolloutIdentity
    state: dict[str, Any]
    record: Record


class ResourcesAdapter:
    """A ``ParticipantAdapter`` over one resources server (a ``SessionHost``) and its session table."""

    def __init__(self, server: SessionHost) -> None:
        self.server = server
        self.mode = server.checkpoint_mode
        self.verify_mode = server.checkpoint_verify
        self.participant: Participant | None = None
        self._in_flight: Counter[RolloutIdentity] = Counter()
        self._blocking: Counter[RolloutIdentity] = Counter()
        self._verifying = 0
        self._parked: set[str] = set()
        self._parked_for: str | None = None
        self._served = False
        self._restored_of: dict[RolloutIdentity, list[str]] = {}
        """The ids of the sessions a restore installed, by the attempt they are bound to: a seed looks up
        its own attempt's here instead of walking every session (thousands, after a restore)."""
        self._retiring: dict[str, RolloutIdentity] = {}

    # ---- data plane -------------------------------------------------------------------------

    def admitted(self, route: Route, identity: RolloutIdentity | None) -> _Admitted:
        """Let one request of ``identity`` in (waiting while a checkpoint is open) and count it while it
        runs; the server resolves the identity (its ``/ng-rollout/`` prefix, its body, its session)."""
        return _Admitted(self, route, identity)

    async def _enter(self, route: Route, named: RolloutIdentity | None) -> tuple[RolloutIdentity, bool]:
        identity = await self._admit(route, named)
        if route == "seed" and self._restored_of:  # only a restored server holds restored sessions
            await self._drop_restored(identity)
        blocking = self._blocks(route)
        self._in_flight[identity] += 1
        if blocking:
            self._blocking[identity] += 1
        if route == "verify":
            self._verifying += 1
        return identity, blocking

    def _exit(self, route: Route, identity: RolloutIdentity, blocking: bool) -> None:
        _release(self._in_flight, identity)
        if blocking:
            _release(self._blocking, identity)
        if route == "verify":
            self._verifying -= 1
        self._participant().notify_changed()

    async def _admit(self, route: Route, identity: RolloutIdentity | None) -> RolloutIdentity:
        participant = self._participant()
        if self.mode == "restart_only":
            _check_marks(participant, identity)
        else:
            await participant.admit(identity)
        if identity is None:  # admit refuses a request without identity; this narrows the type
            raise RolloutIdRequired("checkpointing is on: a rollout-scoped request needs /ng-rollout/<key>/")
        self._served = True
        return identity

    def _blocks(self, route: Route) -> bool:
        if self.mode == "restart_only":
            return False
        return route == "tool" or (route == "verify" and self.verify_mode == "wait")

    def _participant(self) -> Participant:
        assert self.participant is not None, "the adapter is used only once mounted"
        return self.participant

    def seeded(self, session: Session) -> Session:
        """A seed opened ``session``. A stateless server builds its record here, on the data plane:
        built at the first commit instead, the checkpoint after a burst of seeds built thousands of
        them inside its pause (docs/protocol.md section 7)."""
        if self.mode == "stateless":
            _membership_record(session)
        return session

    async def close_elsewhere(self, identity: RolloutIdentity) -> None:
        """A close found no session here: on a multi-worker server another worker may hold it."""
        await self._participant().close_elsewhere(identity)

    # ---- prepare ----------------------------------------------------------------------------

    async def readiness(self) -> Readiness:
        blocking = set(self._blocking) | set(self._retiring.values())
        blockers = sorted({identity.capture_key for identity in blocking})
        if self.mode == "exported":
            await self._park_idle_sessions()
        counts = {
            "sessions": len(self.server.sessions),
            "in_flight": sum(self._in_flight.values()),
            "blocking": sum(self._blocking.values()),
        }
        return Readiness(blockers=blockers, counts=counts, restarts=self._restarts())

    def _restarts(self) -> list[str]:
        if self.mode != "restart_only":
            return []
        live = {s.identity for s in self.server.sessions if s.identity is not None} | set(self._in_flight)
        return sorted(identity.capture_key for identity in live)

    async def _park_idle_sessions(self) -> None:
        """Park every session with no blocking call in flight, once per checkpoint."""
        checkpoint_id = self._participant().checkpoint_id
        if checkpoint_id != self._parked_for:
            self._parked, self._parked_for = set(), checkpoint_id
        for session in self.server.sessions:
            busy = session.identity in self._blocking
            if not busy and session.session_id not in self._parked:
                await self.server.park_session(session)
                self._parked.add(session.session_id)

    # ---- commit -----------------------------------------------------------------------------

    async def export(self, scope: Scope | None) -> AsyncIterator[ExportItem]:
        """Each session's restored record while in scope, else its record (a stateless server's kept
        one, an exported server's state asked afresh)."""
        for item in self._chosen(scope):
            yield item if isinstance(item, Record) else await self._exported_record(*item)

    def export_at_once(self, scope: Scope | None) -> list[Record] | None:
        """``export`` in one list for a stateless server, whose records are kept (``None`` for an
        exported server: its state is asked afresh, one await per session)."""
        return None if self.mode == "exported" else cast(list[Record], self._chosen(scope))

    def _chosen(self, scope: Scope | None) -> list[Record | tuple[Session, RolloutIdentity]]:
        """What a commit exports, session by session, in one loop with no call per session: a
        restored record still in scope, else the session's kept record, or on an exported server the
        session and the identity its state is exported under (nothing on a restart-only server, nor
        of a session being retired)."""
        if self.mode == "restart_only":
            return []
        chosen: list[Record | tuple[Session, RolloutIdentity]] = []
        keep, retiring, exported = chosen.append, self._retiring, self.mode == "exported"
        for session in self.server.sessions:
            if session.session_id in retiring:
                continue
            restored, identity = session.restored, session.identity
            if restored is not None and (scope is None or restored.episode in scope):
                keep(restored)
            elif identity is not None and (scope is None or identity in scope):
                keep((session, identity) if exported else _member_record(session, identity))
        return chosen

    async def _exported_record(self, session: Session, identity: RolloutIdentity) -> dict[str, Any]:
        return {"episode_id": identity.to_json(), "session_id": session.session_id,
                "state": await self.server.export_session(session)}

    async def committed(self, scope: Scope | None) -> Mapping[str, Any]:
        """Drop the restored, untouched sessions that this commit's scope left out."""
        if scope is not None:
            for session in self.server.sessions:
                restored = session.restored
                if restored is not None and restored.episode not in scope and session.identity not in scope:
                    await self.server.drop_session(session.session_id)
        return {}

    async def stop_committed(self, scope: Scope | None) -> None:
        """A stop commit is durable: free what every session holds outside its state."""
        for session in list(self.server.sessions):
            try:
                await self.server.release_session(session)
            except (GymError, OSError, RuntimeError, ValueError) as error:
                logger.warning("releasing session %s after a stop commit failed: %s", session.session_id, error)

    # ---- restore ----------------------------------------------------------------------------

    async def install(self, records: Sequence[Record], scope: Scope) -> None:
        if self._served or len(self.server.sessions):
            raise InvalidPhase("restore expected a fresh resources server, got one that served rollout "
                               "traffic")
        planned = [await self._plan(record) for record in records]
        seen: set[str] = set()
        for plan in planned:
            if plan.session_id in seen:
                raise InvalidCheckpointState(f"session {plan.session_id} appears in more than one record")
            seen.add(plan.session_id)
        for plan in planned:
            self.server.sessions.install(plan.session_id, plan.identity, plan.state, restored=plan.record)
            self._restored_of.setdefault(plan.identity, []).append(plan.session_id)

    async def _plan(self, record: Record) -> _Planned:
        key = record.episode.capture_key
        if self.mode == "restart_only":
            raise InvalidCheckpointState(f"a restart-only server never exports, got a record of {key}")
        expected = {"episode_id", "session_id"} | ({"state"} if self.mode == "exported" else set())
        if set(record.data) != expected:
            raise InvalidCheckpointState(
                f"record of {key}: expected the fields {sorted(expected)}, got {sorted(record.data)}"
            )
        session_id = record.data["session_id"]
        if not isinstance(session_id, str) or not SESSION_ID.fullmatch(session_id):
            raise InvalidCheckpointState(f"record of {key}: session_id {session_id!r} is malformed")
        state = await self._restored_state(record) if self.mode == "exported" else {}
        return _Planned(session_id, record.episode.next_attempt(), state, record)

    async def _restored_state(self, record: Record) -> dict[str, Any]:
        try:
            return await self.server.restore_session(record.data["state"])
        except ValueError as error:
            key = record.episode.capture_key
            raise InvalidCheckpointState(f"record of {key}: malformed session state: {error}") from error

    # ---- retire, forget ---------------------------------------------------------------------

    async def retire(self, episodes: Sequence[RolloutIdentity]) -> None:
        """Wait until the requests of those attempts (and earlier ones) stopped, then free their sessions.

        The participant has fenced them already, so no new request of theirs gets in; a session is
        dropped (``retire_session``) only after its last request in flight has ended.
        """
        marks: dict[str, int] = {}
        for episode in episodes:
            marks[episode.rollout_id] = max(episode.attempt, marks.get(episode.rollout_id, -1))

        def retired(identity: RolloutIdentity | None) -> bool:
            return identity is not None and identity.attempt <= marks.get(identity.rollout_id, -1)

        doomed = {session.session_id: session.identity for session in self.server.sessions
                  if session.identity is not None and retired(session.identity)}
        self._retiring.update(doomed)
        try:
            await self._until_quiet(retired)
            await self._drop_where(retired)
        finally:
            for session_id in doomed:
                self._retiring.pop(session_id, None)

    async def forget(self, rollout_ids: Sequence[str]) -> None:
        gone = set(rollout_ids)
        await self._drop_where(lambda identity: identity is not None and identity.rollout_id in gone)
        for identity in [identity for identity in self._restored_of if identity.rollout_id in gone]:
            del self._restored_of[identity]

    async def _drop_where(self, condition: Callable[[RolloutIdentity | None], bool]) -> None:
        for session in self.server.sessions:
            if condition(session.identity):
                await self.server.drop_session(session.session_id)

    async def _drop_restored(self, identity: RolloutIdentity) -> None:
        """Drop the sessions restored for ``identity`` that no call has touched yet (a touched one, or
        one dropped since, stays as it is)."""
        for session_id in self._restored_of.pop(identity, ()):
            session = self.server.sessions.find(session_id)
            if session is not None and session.restored is not None and session.identity == identity:
                await self.server.drop_session(session_id)

    async def _until_quiet(self, condition: Callable[[RolloutIdentity | None], bool]) -> None:
        """Wait (the participant bounds it by the deadline) until no such request is in flight."""
        signal = self._participant().signal
        while True:
            changed = signal.current
            if not any(condition(identity) for identity in self._in_flight):
                return
            await changed.wait()

    # ---- status -----------------------------------------------------------------------------

    def status_extras(self) -> Mapping[str, Any]:
        sessions = list(self.server.sessions)
        return {
            "checkpoint_mode": self.mode,
            "checkpoint_verify": self.verify_mode,
            "sessions": len(sessions),
            "restored_sessions": sum(1 for session in sessions if session.restored is not None),
            "in_flight_requests": sum(self._in_flight.values()),
            "blocking_requests": sum(self._blocking.values()),
            "verifying_requests": self._verifying,
            "retiring_sessions": len(self._retiring),
        }


class _Admitted:
    """``async with adapter.admitted(route) as identity``: a plain class, cheaper than a generator-based
    context manager on a path every data-plane request takes."""

    __slots__ = ("_adapter", "_entered", "_identity", "_route")

    def __init__(self, adapter: ResourcesAdapter, route: Route, identity: RolloutIdentity | None) -> None:
        self._adapter, self._route, self._identity = adapter, route, identity
        self._entered: tuple[RolloutIdentity, bool] | None = None

    async def __aenter__(self) -> RolloutIdentity:
        self._entered = await self._adapter._enter(self._route, self._identity)
        return self._entered[0]

    async def __aexit__(self, *exc: object) -> None:
        assert self._entered is not None, "exited without entering"
        self._adapter._exit(self._route, *self._entered)


def _release(counter: Counter[RolloutIdentity], identity: RolloutIdentity) -> None:
    counter[identity] -= 1
    if counter[identity] <= 0:
        del counter[identity]


def _check_marks(participant: Participant, identity: RolloutIdentity | None) -> None:
    """Admission without the wait: a call on an existing restart session keeps running."""
    try:
        if identity is None:
            raise RolloutIdRequired("checkpointing is on: a rollout-scoped request needs /ng-rollout/<key>/")
        participant.marks.check(identity)
    except GymError as error:
        participant.telemetry.event("refused", code=error.code)
        raise


def _membership_record(session: Session) -> Record | None:
    """A stateless session's record (its id and identity only), built once per identity and kept
    on the session; ``None`` for a session without identity."""
    identity = session.identity
    return None if identity is None else _member_record(session, identity)


def _member_record(session: Session, identity: RolloutIdentity) -> Record:
    encoded = session.encoded
    if encoded is None or (encoded.episode is not identity and encoded.episode != identity):
        encoded = session.encoded = Record.of_strings(identity, session_id=session.session_id)
    return encoded
