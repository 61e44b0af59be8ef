"""Rollout identity: ``{rollout_id, attempt}``, its capture key, and the request's current identity.

The capture key is ``rollout_id`` for attempt 0 and ``rollout_id-aN`` for attempt N >= 1
(docs/protocol.md section 1). So that capture keys are one-to-one, a ``rollout_id`` matches
``ROLLOUT_ID_PATTERN`` and never ends in ``-a<digits>`` (upstream's ``EpisodeId`` refuses the endings
it would read as an attempt; this project refuses every ``-a<digits>`` ending, ``-a0`` and ``-a01``
included, and bounds the length to 200). Data-plane calls travel under ``/ng-rollout/<capture_key>/``; the server
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
    "MAX_ATTEMPT",
    "MAX_ROLLOUT_ID_LENGTH",
    "ROLLOUT_ID_PATTERN",
    "ROLLOUT_PREFIX",
    "RolloutIdentity",
    "current_identity",
    "parse_capture_key",
    "rollout_id_problem",
    "split_rollout_path",
]

ROLLOUT_PREFIX = "/ng-rollout/"
MAX_ROLLOUT_ID_LENGTH = 200
MAX_ATTEMPT = 999_999_999
ROLLOUT_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$"
_ROLLOUT_ID = re.compile(ROLLOUT_ID_PATTERN)
_RESERVED_ENDING = re.compile(r"-a[0-9]+\Z")
_ATTEMPT_SUFFIX = re.compile(r"(?P<rid>.+)-a(?P<n>[1-9][0-9]{0,8})")


def rollout_id_problem(rollout_id: str) -> str | None:
    """Why ``rollout_id`` is not a valid rollout id, or ``None`` when it is."""
    if not _ROLLOUT_ID.fullmatch(rollout_id):
        return (f"rollout_id {rollout_id[:MAX_ROLLOUT_ID_LENGTH + 1]!r} must match {ROLLOUT_ID_PATTERN} "
                f"(1-{MAX_ROLLOUT_ID_LENGTH} characters: letters, digits, '.', '_', '-')")
    if _RESERVED_ENDING.search(rollout_id):
        return f"rollout_id {rollout_id!r} must not end in -a<digits> (that ending names an attempt)"
    return None


@dataclass(frozen=True, slots=True)
class RolloutIdentity:
    """One attempt of one rollout."""

    rollout_id: str
    attempt: int = 0

    def __post_init__(self) -> None:
        problem = rollout_id_problem(self.rollout_id)
        if problem is not None:
            raise InvalidRequest(problem)
        if not 0 <= self.attempt <= MAX_ATTEMPT:
            raise InvalidRequest(f"attempt must be in 0..{MAX_ATTEMPT}, got {self.attempt}")

    @property
    def capture_key(self) -> str:
        return self.rollout_id if self.attempt == 0 else f"{self.rollout_id}-a{self.attempt}"

    def next_attempt(self) -> RolloutIdentity:
        return RolloutIdentity(self.rollout_id, self.attempt + 1)

    def to_json(self) -> dict[str, object]:
        return {"rollout_id": self.rollout_id, "attempt": self.attempt}


def parse_capture_key(key: str) -> RolloutIdentity:
    """``"r1"`` -> (r1, 0); ``"r1-a2"`` -> (r1, 2). Raises ``InvalidRequest`` for malformed keys."""
    match = _ATTEMPT_SUFFIX.fullmatch(key)
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
