"""The sessions of a resources server: one per seeded rollout, by session id.

A ``Session`` is what the server keeps for one ``/seed_session``: its id (the cookie's value), the
rollout identity it was opened under and its JSON state. ``SessionTable`` is the server's live set;
the checkpoint adapter (``adapter.py``) reads, parks, exports and installs sessions through it.

An id is the server's own (a fresh uuid) or the caller's (NeMo Gym's environment servers name it
``resources_session_id``). The table remembers the last ``CLOSED_REMEMBERED`` ids closed, so that a
seed arriving after the close of its id (a race NeMo Gym's contract rules out) cannot open it again.
"""

from __future__ import annotations

import re
import uuid
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from nemo_gym_ckpt.checkpoint.records import Record
from nemo_gym_ckpt.errors import InvalidRequest
from nemo_gym_ckpt.identity import RolloutIdentity

__all__ = ["CLOSED_REMEMBERED", "Session", "SessionTable", "session_cookie_name"]

CLOSED_REMEMBERED = 65536


@dataclass
class Session:
    """One seeded session: its id, the rollout identity it was opened under, its JSON state.

    ``restored`` is the checkpoint record a restored session came from, kept until a call touches
    the session (it is then exported afresh); ``encoded`` is the record of a stateless server's
    session (its id and identity only: built once, at its seed, and looked up at each commit).
    Neither takes part in equality.
    """

    session_id: str
    identity: RolloutIdentity | None
    state: dict[str, Any] = field(default_factory=dict)
    restored: Record | None = field(default=None, compare=False, repr=False)
    encoded: Record | None = field(default=None, compare=False, repr=False)

    def to_json(self) -> dict[str, Any]:
        identity = self.identity.to_json() if self.identity else None
        return {"session_id": self.session_id, "identity": identity, "state": self.state}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Session:
        identity = data.get("identity")
        restored = RolloutIdentity(identity["rollout_id"], identity["attempt"]) if identity else None
        return cls(data["session_id"], restored, data.get("state") or {})

class SessionTable:
    """The live sessions of one server, by session id."""

    def __init__(self) -> None:
        self._sessions: dict[str, Session] = {}
        self._closed: deque[str] = deque(maxlen=CLOSED_REMEMBERED)
        self._closed_set: set[str] = set()

    def open(self, identity: RolloutIdentity | None, state: dict[str, Any], session_id: str | None = None) -> Session:
        """A new session under ``session_id`` (a fresh one when None); ``InvalidRequest`` for an id in use
        or closed."""
        session_id = session_id or uuid.uuid4().hex
        if session_id in self._sessions or self.was_closed(session_id):
            raise InvalidRequest(f"session {session_id!r} is in use or was closed")
        session = Session(session_id, identity, state)
        self._sessions[session.session_id] = session
        return session

    def was_closed(self, session_id: str) -> bool:
        """Whether ``session_id`` is among the ids closed lately."""
        return session_id in self._closed_set

    def note_closed(self, session_id: str) -> None:
        """Remember ``session_id`` as closed (the oldest remembered id is forgotten first)."""
        if session_id in self._closed_set:
            return
        if len(self._closed) == self._closed.maxlen:
            self._closed_set.discard(self._closed[0])
        self._closed.append(session_id)
        self._closed_set.add(session_id)

    def find(self, session_id: str | None) -> Session | None:
        """The session with this id, if there is one."""
        return self._sessions.get(session_id or "")

    def get(self, session_id: str | None) -> Session:
        """The session with this id; ``InvalidRequest`` when there is none."""
        if not session_id:
            raise InvalidRequest("no session: call /seed_session first and pass its session cookie")
        session = self._sessions.get(session_id)
        if session is None:
            raise InvalidRequest(f"unknown session {session_id!r}: not seeded here, or already closed")
        return session

    def close(self, session_id: str | None) -> bool:
        return self.pop(session_id) is not None

    def pop(self, session_id: str | None) -> Session | None:
        """Remove and return the session with this id (``None`` when there is none)."""
        return self._sessions.pop(session_id or "", None)

    def add(self, session: Session) -> None:
        self._sessions[session.session_id] = session

    def install(
        self, session_id: str, identity: RolloutIdentity, state: dict[str, Any], *, restored: Record
    ) -> Session:
        """Put back a session read from a checkpoint: same id (its cookie still works), new attempt."""
        session = Session(session_id, identity, state, restored=restored)
        self.add(session)
        return session

    def __len__(self) -> int:
        return len(self._sessions)

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._sessions

    def __iter__(self) -> Iterator[Session]:
        return iter(list(self._sessions.values()))

def session_cookie_name(instance: str) -> str:
    """The session cookie of one server instance (distinct per instance, cookie-safe)."""
    return "ng_session_" + re.sub(r"[^A-Za-z0-9_-]", "_", instance)
