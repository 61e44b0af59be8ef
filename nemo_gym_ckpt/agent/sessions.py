"""Agent sessions as checkpoint participants (kind ``agent``): activations, boundaries, snapshots.

An agent keeps one session per episode (its capture key); the environment invokes it once per
activation with ``x-ng-agent-activation: <n>`` (1-based, docs/protocol.md section 7). With the mesh's
``checkpoint:`` block on, ``AgentSessions`` is both the agent's session table and its
``ParticipantAdapter``. An agent hands each activation's work to ``activate``:

- **activations**: activation n runs as its own task. Invoking the activation that completed last
  again answers its reply without running anything; invoking the one that runs now joins it; any
  other index than the next one is ``activation_out_of_order``. The request of a repeated index
  must be the same (``request_digest``: its canonical JSON without token arrays is compared):
  otherwise ``activation_out_of_order``, or ``invalid_checkpoint_state`` for a session restored
  from a checkpoint.
- **boundaries**: the work makes every outside call inside ``turn.call("model" | "tool")``.
  Between calls a session stands at a boundary; a session awaiting a model reply counts as one too
  (during a checkpoint the policy model holds the reply and leaves the call out of its ledger, so
  the call is simply made again after a restore). A tool call in flight blocks a prepare: it must
  not run twice. A session about to make a call while a checkpoint is open parks until resume.
- **snapshots**: the work registers ``turn.track(snapshot)``, a function answering its JSON state
  at the last boundary. It is evaluated, and the session's record built from it, where the session
  stands still: as each call starts, and as it parks (``encode_now``), on the data plane and only
  with checkpointing on; a commit then only looks the record up, and builds it only for a session
  that moved since. The answer may share its lists and dicts with the live state: the record copies
  every one of them (leaving token arrays out) before the work can run again.
- **records**: ``{"episode_id", "session": {"completed", "completed_digest", "reply", "running"}}``:
  the last completed activation (its index, request digest and reply, so that a re-invocation after
  a restore gets the same answer) and the one running, if any (``{"index", "request_digest",
  "state"}``, ``state`` being the snapshot, ``null`` before its first call). Records never carry
  token arrays: the token capture fields are left out of the reply and the state, so a restored
  session's state lacks the token arrays of the calls it made before the checkpoint. The policy
  model keeps them in its token sidecar and answers them at ``GET /v1/capture/tokens`` under the
  rollout's capture key; an agent puts them back on its restored items (the simple agent does, see
  ``agents/simple_agent/restored_tokens.py``). A restored completed reply lacks them too: when the
  environment invokes that activation again, the reply passes through the agent's ``refill`` hook
  (given to ``AgentSessions``) before it is answered, and the refilled reply is kept for the next
  time; nothing runs again (no model or tool call), and the record stays the restored one.
- **restore** installs every session under the next attempt, all or nothing; ``check_state``
  vets each running state. The environment's re-invocation of the running index under the new
  capture key continues the work from that state (``turn.resume``), so no completed model or tool
  call is made again. Until its first activation the session exports the very record it came from.
- **retire** and **forget** cancel the sessions' running activations (their callers get
  ``stale_attempt``), wait for them to end and drop the sessions; so does ``close`` (``/close``).
  Retire and forget then hand the agent's ``release`` hook (given to ``AgentSessions``) a predicate
  naming the episodes they ended (a retire: the attempts retired and the earlier ones of those
  rollouts; a forget: every attempt of those rollouts), for what it keeps per episode beside them.

A restart-only agent (``restart_only=True``) cannot capture its sessions: they are ``restarts``
that never park, never block and are never exported; a restore with any record of it is
``invalid_checkpoint_state``. A new session of it waits while a checkpoint is open (membership
never changes under one); calls of existing sessions keep running.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Literal

from nemo_gym_ckpt.canonical import canonical_json
from nemo_gym_ckpt.capture import without_token_arrays
from nemo_gym_ckpt.checkpoint.adapter import ExportItem, Readiness
from nemo_gym_ckpt.checkpoint.participant import Participant
from nemo_gym_ckpt.checkpoint.records import TOKEN_ARRAY_KEYS, Record, Scope
from nemo_gym_ckpt.errors import (
    ActivationOutOfOrder,
    GymError,
    InvalidCheckpointState,
    InvalidPhase,
    RolloutIdRequired,
    StaleAttempt,
)
from nemo_gym_ckpt.identity import RolloutIdentity, current_identity

__all__ = [
    "RECORD_KEYS",
    "RECORD_LEVELS",
    "RUNNING_KEYS",
    "SESSION_KEYS",
    "Activation",
    "ActivationReply",
    "AgentSession",
    "AgentSessions",
    "CallKind",
    "Refill",
    "Release",
    "Turn",
    "Work",
    "request_digest",
]

CallKind = Literal["model", "tool"]
RECORD_KEYS = frozenset({"episode_id", "session"})
RECORD_LEVELS = 3
"""Levels a record wraps an activation's reply (its response) and a running activation's state in:
the record, its ``session``, its ``reply`` or ``running``. What an agent keeps there must be writable
that much deeper (``MAX_JSON_LEVELS``)."""
SESSION_KEYS = frozenset({"completed", "completed_digest", "reply", "running"})
RUNNING_KEYS = frozenset({"index", "request_digest", "state"})
_DIGEST = re.compile(r"[0-9a-f]{64}")
_TOKEN_KEYS_JSON = tuple(canonical_json(key) for key in TOKEN_ARRAY_KEYS)  # b'"prompt_token_ids"'...


@dataclass(frozen=True)
class ActivationReply:
    """What one activation answers: the Responses object and the cookies it sets."""

    response: dict[str, Any]
    cookies: dict[str, str]

    def to_json(self) -> dict[str, Any]:
        return {"response": self.response, "cookies": self.cookies}

    @classmethod
    def from_json(cls, data: Any) -> ActivationReply:
        """A reply read from a checkpoint; ``ValueError`` when malformed."""
        if not isinstance(data, dict) or set(data) != {"response", "cookies"}:
            raise ValueError("a reply is {response, cookies}")
        response, cookies = data["response"], data["cookies"]
        if not isinstance(response, dict) or not isinstance(cookies, dict):
            raise ValueError("a reply's response and cookies are objects")
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in cookies.items()):
            raise ValueError("a reply's cookies map names to strings")
        return cls(response, cookies)


@dataclass(eq=False)
class Activation:
    """The activation a session runs now (or was running when it was checkpointed)."""

    index: int
    request_digest: str
    resume: dict[str, Any] | None = None
    snapshot: Callable[[], dict[str, Any]] | None = None
    task: asyncio.Task[ActivationReply] | None = None
    version: int = 0  # bumped as each of its calls starts and ends (the only times its state changes)

    def state(self) -> dict[str, Any] | None:
        """The work's state at its last boundary (evaluated now), or the restored one."""
        return self.snapshot() if self.snapshot is not None else self.resume

    def to_json(self) -> dict[str, Any]:
        return {"index": self.index, "request_digest": self.request_digest, "state": self.state()}


@dataclass(eq=False)
class AgentSession:
    """One episode's agent session."""

    identity: RolloutIdentity
    restart: bool = False
    completed: int = 0
    completed_digest: str | None = None
    reply: ActivationReply | None = None
    running: Activation | None = None
    call: CallKind | None = None
    parked: bool = False
    restored: Record | None = None
    from_checkpoint: bool = False
    _encoded: tuple[int, ActivationReply | None, Activation | None, int, Record] | None = None

    @property
    def key(self) -> str:
        return self.identity.capture_key

    def record(self) -> dict[str, Any]:
        """The session's record (the running state evaluated now), without token arrays."""
        session = {
            "completed": self.completed,
            "completed_digest": self.completed_digest,
            "reply": None if self.reply is None else self.reply.to_json(),
            "running": None if self.running is None else self.running.to_json(),
        }
        return {"episode_id": self.identity.to_json(), "session": without_token_arrays(session)}

    def record_for(self, scope: Scope | None) -> Record | None:
        if self.restored is not None and (scope is None or self.restored.episode in scope):
            return self.restored
        if scope is None or self.identity in scope:
            return self.encoded()
        return None

    def encoded(self) -> Record:
        """The record, built again only when the session moved: an activation completed, or a call
        of the running one started or ended (a work changes its state only around its calls)."""
        running, cached = self.running, self._encoded
        version = running.version if running is not None else -1
        if (cached is None or cached[0] != self.completed or cached[1] is not self.reply
                or cached[2] is not running or cached[3] != version):
            cached = self._encoded = (self.completed, self.reply, running, version, Record.from_data(self.record()))
        return cached[4]


Work = Callable[["Turn"], Awaitable[ActivationReply]]
StateCheck = Callable[[dict[str, Any]], None]
Refill = Callable[[ActivationReply], Awaitable[ActivationReply]]
"""Puts back what records strip (token arrays) on a restored completed reply answered again."""
Release = Callable[[Callable[[RolloutIdentity], bool]], None]
"""Drops what an agent keeps per episode beside its sessions (the simple agent: NeMo Gym's agent
sessions) for the episodes the predicate names: called by ``retire`` and ``forget``."""


def _any_object(state: dict[str, Any]) -> None:
    return None


class Turn:
    """What an activation's work is given: where to resume from, the snapshot hook, the call gate."""

    def __init__(self, sessions: AgentSessions, session: AgentSession, activation: Activation) -> None:
        self._sessions = sessions
        self.session = session
        self.activation = activation

    @property
    def resume(self) -> dict[str, Any] | None:
        """The state to continue from (a restored activation), or ``None`` to start afresh."""
        return self.activation.resume

    def track(self, snapshot: Callable[[], dict[str, Any]]) -> None:
        """Register the function answering the work's JSON state at its last boundary. The work
        changes that state only around its calls (``call``), so a record taken between two of them
        is built once."""
        self.activation.snapshot = snapshot
        self.activation.version += 1

    @asynccontextmanager
    async def call(self, kind: CallKind) -> AsyncIterator[None]:
        """One outside call: parks first while a checkpoint is open, and is counted once it completed."""
        await self._sessions.park(self.session)
        self.session.call = kind
        self.activation.version += 1
        self._sessions.encode_now(self.session)  # the state stands still until the call ends
        try:
            yield
            self._sessions.completed_calls[kind] += 1
        finally:
            self.activation.version += 1
            self.session.call = None
            self._sessions.notify()


class AgentSessions:
    """The sessions of one agent server, and its ``ParticipantAdapter``."""

    def __init__(
        self, *, restart_only: bool = False, check_state: StateCheck = _any_object, refill: Refill | None = None,
        release: Release | None = None,
    ) -> None:
        self.restart_only = restart_only
        self.check_state = check_state
        self.refill = refill
        self.release = release
        self.participant: Participant | None = None
        self.sessions: dict[str, AgentSession] = {}
        self.completed_calls: Counter[str] = Counter()

    # ---- data plane -------------------------------------------------------------------------

    async def activate(self, index: int | None, request: Mapping[str, Any], work: Work) -> ActivationReply:
        """Run (or answer again, or join) activation ``index`` of the request's session."""
        identity = await self._admit()
        session = self.sessions.get(identity.capture_key)
        if session is None:
            session = self.sessions[identity.capture_key] = AgentSession(identity, restart=self.restart_only)
        found = self._activation(session, index, request_digest(request))
        if isinstance(found, ActivationReply):
            return await self._again(session, found)
        if found.task is None:
            found.task = self._spawn(session, found, work)
        return await _outcome(found, session.key)

    async def _again(self, session: AgentSession, reply: ActivationReply) -> ActivationReply:
        """A completed reply answered again; one restored from a checkpoint through ``refill`` first."""
        if not session.from_checkpoint or self.refill is None:
            return reply
        refilled = await self.refill(reply)
        if session.reply is reply:
            session.reply = refilled
        return refilled

    def fenced(self) -> RolloutIdentity:
        """The request's identity, checked against the retire fences only (never waits): for calls
        that change nothing and may come from a step a checkpoint waits for."""
        identity = current_identity()
        if identity is None:
            raise RolloutIdRequired("checkpointing is on: this agent call needs /ng-rollout/<key>/")
        _check_marks(self._participant(), identity)
        return identity

    async def admitted(self) -> RolloutIdentity:
        """Admission of a request that starts or ends an episode's work without an activation (NeMo
        Gym's agent-session seed and close): waits while a checkpoint is open."""
        return await self._admit()

    async def close(self) -> bool:
        """``/close``: stop the request's session (its running activation too) and drop it."""
        identity = await self._admit()
        session = self.sessions.get(identity.capture_key)
        if session is None:
            await self._participant().close_elsewhere(identity)  # another worker of this agent may hold it
            return False
        await self._drop([session])
        return True

    async def _admit(self) -> RolloutIdentity:
        """Wait while a checkpoint is open (a restart session's calls only check the fences)."""
        identity = current_identity()
        participant = self._participant()
        known = self.sessions.get(identity.capture_key) if identity is not None else None
        if known is not None and known.restart:
            _check_marks(participant, known.identity)
        else:
            await participant.admit(identity)
        if identity is None:  # admit refuses a request without identity; this narrows the type
            raise RolloutIdRequired("checkpointing is on: an agent call needs /ng-rollout/<key>/")
        return identity

    def _activation(
        self, session: AgentSession, index: int | None, digest: str
    ) -> ActivationReply | Activation:
        index = session.completed + 1 if index is None else index
        running = session.running
        if running is not None:
            if index != running.index:
                raise ActivationOutOfOrder(f"activation {index} of {session.key} while activation "
                                           f"{running.index} runs")
            _same_request(session, running.request_digest, digest, index)
            return running
        if index == session.completed and session.reply is not None:
            _same_request(session, session.completed_digest, digest, index)
            return session.reply
        if index != session.completed + 1:
            raise ActivationOutOfOrder(f"activation {index} of {session.key}: expected "
                                       f"{session.completed + 1} (or {session.completed} again)")
        session.running = Activation(index, digest)
        return session.running

    def _spawn(
        self, session: AgentSession, activation: Activation, work: Work
    ) -> asyncio.Task[ActivationReply]:
        session.restored = None
        self.notify()
        return asyncio.create_task(self._perform(session, activation, work))

    async def _perform(self, session: AgentSession, activation: Activation, work: Work) -> ActivationReply:
        try:
            reply = await work(Turn(self, session, activation))
        finally:
            if session.running is activation:
                session.running = None
            self.notify()
        session.completed, session.completed_digest = activation.index, activation.request_digest
        session.reply = reply
        return reply

    async def park(self, session: AgentSession) -> None:
        """Wait at this boundary while a checkpoint is open (restarts never park)."""
        participant = self._participant()
        if session.restart or participant.checkpoint_id is None:
            return
        self.encode_now(session)
        session.parked = True
        participant.notify_changed()
        try:
            await participant.admit(session.identity)
        finally:
            session.parked = False

    def encode_now(self, session: AgentSession) -> None:
        """Build the session's record now, on the data plane, where it stands still until it moves
        again (parked, or in a call): a commit that finds it there only looks it up. The record is
        built again only if the session moved since (``AgentSession.encoded``)."""
        if self.participant is not None and not session.restart and session.restored is None:
            session.encoded()

    def notify(self) -> None:
        if self.participant is not None:
            self.participant.notify_changed()

    async def aclose(self) -> None:
        """Stop every running activation (at shutdown)."""
        await self._drop(list(self.sessions.values()))

    # ---- prepare ----------------------------------------------------------------------------

    async def readiness(self) -> Readiness:
        return self._survey(with_lists=True)

    def _counts(self) -> dict[str, int]:
        return dict(self._survey(with_lists=False).counts)

    def _survey(self, *, with_lists: bool) -> Readiness:
        """Blockers (a tool call in flight), restarts and counts in one pass over the sessions."""
        restarts: list[str] = []
        blockers: list[str] = []
        running = awaiting_model = in_tool = parked = restored = restart_count = 0
        for session in self.sessions.values():
            call = session.call
            running += session.running is not None
            awaiting_model += call == "model"
            in_tool += call == "tool"
            parked += session.parked
            restored += session.restored is not None
            if session.restart:
                restart_count += 1
                if with_lists:
                    restarts.append(session.key)
            elif call == "tool" and with_lists:
                blockers.append(session.key)
        counts = {"sessions": len(self.sessions), "running": running, "awaiting_model": awaiting_model,
                  "in_tool_call": in_tool, "parked": parked, "restored": restored, "restarts": restart_count,
                  "model_calls": self.completed_calls["model"], "tool_calls": self.completed_calls["tool"]}
        return Readiness(blockers=blockers, counts=counts, restarts=restarts)

    # ---- commit -----------------------------------------------------------------------------

    async def export(self, scope: Scope | None) -> AsyncIterator[ExportItem]:
        for record in self.export_at_once(scope):
            yield record

    def export_at_once(self, scope: Scope | None) -> list[Record]:
        """``export`` in one list: each session's record is at hand (built again only if it moved)."""
        records: list[Record] = []
        for session in self.sessions.values():
            record = None if session.restart else session.record_for(scope)
            if record is not None:
                records.append(record)
        return records

    async def committed(self, scope: Scope | None) -> Mapping[str, Any]:
        """Drop the restored, untouched sessions that this commit's scope left out."""
        if scope is not None:
            left_out = [session for session in self.sessions.values() if session.restored is not None
                        and session.restored.episode not in scope and session.identity not in scope]
            await self._drop(left_out)
        return {}

    # ---- restore ----------------------------------------------------------------------------

    async def install(self, records: Sequence[Record], scope: Scope) -> None:
        if self.sessions:
            raise InvalidPhase("restore expected an agent with no sessions, got one with some")
        planned: dict[str, AgentSession] = {}
        for record in records:
            session = self._plan(record)
            if session.key in planned:
                raise InvalidCheckpointState(f"session {record.episode.capture_key} has more than one record")
            planned[session.key] = session
        self.sessions.update(planned)

    def _plan(self, record: Record) -> AgentSession:
        key = record.episode.capture_key
        if self.restart_only:
            raise InvalidCheckpointState(f"a restart-only agent never exports, got a record of {key}")
        if set(record.data) != RECORD_KEYS or not isinstance(record.data["session"], dict):
            raise InvalidCheckpointState(f"record of {key}: expected {sorted(RECORD_KEYS)} with a session "
                                         f"object, got {sorted(record.data)}")
        try:
            return self._session_of(record)
        except ValueError as error:
            raise InvalidCheckpointState(f"record of {key}: {error}") from None

    def _session_of(self, record: Record) -> AgentSession:
        data = record.data["session"]
        if set(data) != SESSION_KEYS:
            raise ValueError(f"a session has the fields {sorted(SESSION_KEYS)}, got {sorted(data)}")
        completed = _count(data["completed"], "completed", minimum=0)
        reply = None if data["reply"] is None else ActivationReply.from_json(data["reply"])
        digest = data["completed_digest"]
        if (completed == 0) != (reply is None) or (completed == 0) != (digest is None):
            raise ValueError("completed, completed_digest and reply must be all set or all empty")
        if digest is not None:
            _digest(digest, "completed_digest")
        running = None if data["running"] is None else self._running_of(data["running"], completed)
        return AgentSession(record.episode.next_attempt(), completed=completed, completed_digest=digest,
                            reply=reply, running=running, restored=record, from_checkpoint=True)

    def _running_of(self, data: Any, completed: int) -> Activation:
        if not isinstance(data, dict) or set(data) != RUNNING_KEYS:
            raise ValueError(f"a running activation has the fields {sorted(RUNNING_KEYS)}")
        index = _count(data["index"], "running.index", minimum=1)
        if index != completed + 1:
            raise ValueError(f"the running activation is {index}, expected {completed + 1}")
        state = data["state"]
        if state is not None:
            if not isinstance(state, dict):
                raise ValueError("a running activation's state is an object or null")
            self.check_state(state)
        return Activation(index, _digest(data["request_digest"], "request_digest"), resume=state)

    # ---- retire, forget ---------------------------------------------------------------------

    async def retire(self, episodes: Sequence[RolloutIdentity]) -> None:
        marks: dict[str, int] = {}
        for episode in episodes:
            marks[episode.rollout_id] = max(episode.attempt, marks.get(episode.rollout_id, -1))

        def retired(identity: RolloutIdentity) -> bool:
            return identity.attempt <= marks.get(identity.rollout_id, -1)

        await self._drop([s for s in self.sessions.values() if retired(s.identity)])
        self._release(retired)

    async def forget(self, rollout_ids: Sequence[str]) -> None:
        gone = set(rollout_ids)

        def forgotten(identity: RolloutIdentity) -> bool:
            return identity.rollout_id in gone

        await self._drop([s for s in self.sessions.values() if forgotten(s.identity)])
        self._release(forgotten)

    def _release(self, ended: Callable[[RolloutIdentity], bool]) -> None:
        """Have the agent drop what it keeps beside these sessions for the episodes ``ended`` names."""
        if self.release is not None:
            self.release(ended)

    async def _drop(self, sessions: Sequence[AgentSession]) -> None:
        """Drop the sessions; cancel their running activations and wait for them to end."""
        tasks = []
        for session in sessions:
            if self.sessions.get(session.key) is session:
                del self.sessions[session.key]
            if session.running is not None and session.running.task is not None:
                session.running.task.cancel()
                tasks.append(session.running.task)
        if tasks:
            await asyncio.wait(tasks)
        self.notify()

    # ---- status -----------------------------------------------------------------------------

    def status_extras(self) -> Mapping[str, Any]:
        return {"checkpoint_sessions": not self.restart_only, **self._counts()}

    def _participant(self) -> Participant:
        assert self.participant is not None, "the sessions are used only once mounted"
        return self.participant


def request_digest(request: Mapping[str, Any]) -> str:
    """What identifies an activation's request: its canonical JSON without token arrays (a restored
    caller re-sends its conversation without them, as records never carry them).

    The canonical JSON of the request is hashed as it is when no token-array key occurs in it (a
    key is written as its quoted name, so its absence from the bytes proves there is none): the
    same bytes as without them, without copying the request. Otherwise they are left out first.
    """
    data = canonical_json(dict(request))
    if any(key in data for key in _TOKEN_KEYS_JSON):
        data = canonical_json(without_token_arrays(dict(request)))
    return hashlib.sha256(data).hexdigest()


async def _outcome(activation: Activation, key: str) -> ActivationReply:
    """Await the activation; a caller cancelled while waiting stops it too."""
    task = activation.task
    assert task is not None
    try:
        await asyncio.wait({task})
    except asyncio.CancelledError:
        task.cancel()
        raise
    if task.cancelled():
        raise StaleAttempt(f"activation {activation.index} of {key} was stopped: its attempt was retired "
                           f"or its session closed")
    return task.result()


def _same_request(session: AgentSession, expected: str | None, digest: str, index: int) -> None:
    if expected == digest:
        return
    detail = f"activation {index} of {session.key} was invoked again with another request"
    if session.from_checkpoint:
        raise InvalidCheckpointState(f"{detail} than the one checkpointed")
    raise ActivationOutOfOrder(detail)


def _check_marks(participant: Participant, identity: RolloutIdentity) -> None:
    """Admission without the wait, for a restart session that keeps running: the fences only."""
    try:
        participant.marks.check(identity)
    except GymError as error:
        participant.telemetry.event("refused", code=error.code)
        raise


def _count(value: Any, name: str, *, minimum: int) -> int:
    if type(value) is not int or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def _digest(value: Any, name: str) -> str:
    if not isinstance(value, str) or not _DIGEST.fullmatch(value):
        raise ValueError(f"{name} is not a SHA-256 hex digest")
    return value
