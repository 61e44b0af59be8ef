"""Rollout identity: ``{rollout_id, attempt}``, its capture key, and the request's current identity.

The capture key is ``rollout_id`` for attempt 0 and ``rollout_id-aN`` for attempt N >= 1
(docs/protocol.md section 1). Data-plane calls travel under ``/ng-rollout/<capture_key>/``; the server
middleware strips the prefix and sets ``CURRENT_IDENTITY`` for the request, and the mesh client
adds the same prefix to the calls that request makes downstream.
"""

from __future__ import annotations

import re
from contextvars import ContextVar
from dataclasses import dataclass

from nemo_gym_ckpt.errors import InvalidRequest

__all__ = [
    "CURRENT_IDENTITY",
    "ROLLOUT_PREFIX",
    "RolloutIdentity",
    "current_identity",
    "parse_capture_key",
    "split_rollout_path",
]

ROLLOUT_PREFIX = "/ng-rollout/"
_ROLLOUT_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,199}$")
_ATTEMPT_SUFFIX = re.compile(r"^(?P<rid>.+)-a(?P<n>[1-9][0-9]{0,8})$")


@dataclass(frozen=True, slots=True)
class RolloutIdentity:
    """One attempt of one rollout."""

    rollout_id: str
    attempt: int = 0

    def __post_init__(self) -> None:
        if not _ROLLOUT_ID.match(self.rollout_id):
            raise InvalidRequest(f"invalid rollout_id {self.rollout_id!r}")
        if self.attempt < 0:
            raise InvalidRequest(f"attempt must be >= 0, got {self.attempt}")

    @property
    def capture_key(self) -> str:
        return self.rollout_id if self.attempt == 0 else f"{self.rollout_id}-a{self.attempt}"

    def next_attempt(self) -> RolloutIdentity:
        return RolloutIdentity(self.rollout_id, self.attempt + 1)

    def to_json(self) -> dict[str, object]:
        return {"rollout_id": self.rollout_id, "attempt": self.attempt}


def parse_capture_key(key: str) -> RolloutIdentity:
    """``"r1"`` -> (r1, 0); ``"r1-a2"`` -> (r1, 2). Raises ``InvalidRequest`` for malformed keys."""
    match = _ATTEMPT_SUFFIX.match(key)
    if match:
        return RolloutIdentity(match["rid"], int(match["n"]))
    return RolloutIdentity(key, 0)


def split_rollout_path(path: str) -> tuple[RolloutIdentity | None, str]:
    """Split ``/ng-rollout/<key>/rest`` into (identity, ``/rest``); other paths pass unchanged."""
    if not path.startswith(ROLLOUT_PREFIX):
        return None, path
    key, slash, rest = path[len(ROLLOUT_PREFIX) :].partition("/")
    if not key:
        raise InvalidRequest("empty capture key in /ng-rollout/ prefix")
    return parse_capture_key(key), "/" + rest if slash else "/"


CURRENT_IDENTITY: ContextVar[RolloutIdentity | None] = ContextVar("ng_rollout_identity", default=None)


def current_identity() -> RolloutIdentity | None:
    """The identity of the request being served, if it came under a rollout prefix."""
    return CURRENT_IDENTITY.get()
