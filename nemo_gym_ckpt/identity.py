"""Rollout identity: ``{rollout_id, attempt}``, its capture key, and the request's current identity.

The capture key is ``rollout_id`` for attempt 0 and ``rollout_id-aN`` for attempt N >= 1
(docs/protocol.md section 1). So that capture keys are one-to-one, a ``rollout_id`` matches
``ROLLOUT_ID_PATTERN`` and never ends in ``-a<digits>`` (upstream's ``EpisodeId`` refuses the endings
it would read as an attempt; this project refuses every ``-a<digits>`` ending, ``-a0`` and ``-a01``
included, and bounds the length to 200). Data-plane calls travel under ``/ng-rollout/<capture_key>/``; the server
middleware strips the prefix and sets ``CURRENT_IDENTITY`` for the request, and the mesh client
adds the same prefix to the calls that request makes downstream.

NeMo Gym's collector names a rollout in the body instead (docs/nemo-gym.md, "Servers' API"): a flat
row carries ``_ng_task_index``, ``_ng_rollout_index`` (the rollout id is ``"<task>-<rollout>"``,
unless ``_ng_rollout_id`` names one) and, from the second attempt on, ``_ng_attempt_index``; an
episode request carries ``episode_id: {rollout_id, attempt}``. ``identity_of_row`` and
``identity_of_episode_id`` read those; ``request_identity`` joins them with the prefix (the two
must agree), and ``without_dispatch_keys`` is the task row without the collector's keys (they
change from one attempt to the next, the task does not); an environment keeps the task and rollout
index in its task (``without_attempt_keys``): NeMo Gym's verifiers read them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from nemo_gym_ckpt.errors import InvalidRequest

__all__ = [
    "CURRENT_IDENTITY",
    "DISPATCH_KEYS",
    "KNOWN_LIMIT",
    "MAX_ATTEMPT",
    "MAX_ROLLOUT_ID_LENGTH",
    "ROLLOUT_ID_PATTERN",
    "ROLLOUT_PREFIX",
    "RolloutIdentity",
    "current_identity",
    "identities_of_episode_ids",
    "identity_of_episode_id",
    "identity_of_row",
    "known_identity",
    "naming_the_attempt",
    "parse_capture_key",
    "request_identity",
    "rollout_id_problem",
    "serving_as",
    "split_rollout_path",
    "without_attempt_keys",
    "without_dispatch_keys",
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
    """One attempt of one rollout. Its hash and its ``capture_key`` are computed once: a checkpoint
    looks up every episode in sets and dicts, and names it, several times in each participant,
    inside the pause.

    ``capture_key`` is how the attempt is named on the wire (``/ng-rollout/<capture_key>/``, commit
    replies): the rollout id for attempt 0, ``<rollout_id>-a<attempt>`` after it."""

    rollout_id: str
    attempt: int = 0
    _hash: int = field(init=False, repr=False, compare=False, default=0)
    capture_key: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        problem = rollout_id_problem(self.rollout_id)
        if problem is not None:
            raise InvalidRequest(problem)
        if not 0 <= self.attempt <= MAX_ATTEMPT:
            raise InvalidRequest(f"attempt must be in 0..{MAX_ATTEMPT}, got {self.attempt}")
        object.__setattr__(self, "_hash", hash((self.rollout_id, self.attempt)))
        key = self.rollout_id if self.attempt == 0 else f"{self.rollout_id}-a{self.attempt}"
        object.__setattr__(self, "capture_key", key)

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self) -> tuple[type[RolloutIdentity], tuple[str, int]]:
        """Rebuilt from its fields (checked, and hashed again: a string's hash differs by process)."""
        return RolloutIdentity, (self.rollout_id, self.attempt)

    def next_attempt(self) -> RolloutIdentity:
        return known_identity(self.rollout_id, self.attempt + 1)

    def to_json(self) -> dict[str, object]:
        return {"rollout_id": self.rollout_id, "attempt": self.attempt}


KNOWN_LIMIT = 65_536
_KNOWN: dict[tuple[str, int], RolloutIdentity] = {}


def known_identity(rollout_id: str, attempt: int) -> RolloutIdentity:
    """``RolloutIdentity(rollout_id, attempt)``, looked up when one was made here before: a
    checkpoint reads much the same episodes again and again (every scope, every record of a worker
    or a file), and a lookup costs a tenth of the checks. At most ``KNOWN_LIMIT`` are remembered,
    then the memory is emptied. Raises ``InvalidRequest`` as the constructor does."""
    key = (rollout_id, attempt)
    known = _KNOWN.get(key)
    if known is None:
        known = RolloutIdentity(rollout_id, attempt)
        if len(_KNOWN) >= KNOWN_LIMIT:
            _KNOWN.clear()
        _KNOWN[key] = known
    return known


def parse_capture_key(key: str) -> RolloutIdentity:
    """``"r1"`` -> (r1, 0); ``"r1-a2"`` -> (r1, 2). Raises ``InvalidRequest`` for malformed keys.

    The identity is the one ``known_identity`` holds: every request of a rollout names the same
    object, so a checkpoint's scope (read the same way) finds each episode by identity, never by
    comparing fields."""
    match = _ATTEMPT_SUFFIX.fullmatch(key)
    if match:
        return known_identity(match["rid"], int(match["n"]))
    return known_identity(key, 0)


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


# ---- identity as NeMo Gym's collector passes it ------------------------------------------------

TASK_INDEX, ROLLOUT_INDEX, ATTEMPT_INDEX, ROLLOUT_ID = (
    "_ng_task_index", "_ng_rollout_index", "_ng_attempt_index", "_ng_rollout_id")
DISPATCH_KEYS = (TASK_INDEX, ROLLOUT_INDEX, ATTEMPT_INDEX, ROLLOUT_ID)
"""The keys NeMo Gym's collector adds to a task row when it dispatches it."""
_MAX_ATTEMPT = 999_999_999
_EPISODE_ID_KEYS = frozenset({"rollout_id", "attempt"})


def _count(row: Mapping[str, Any], key: str) -> int | None:
    value = row.get(key)
    if value is None:
        return None
    if type(value) is not int or not 0 <= value <= _MAX_ATTEMPT:
        raise InvalidRequest(f"{key} must be an integer from 0 to {_MAX_ATTEMPT}, got {value!r}")
    return value


def identity_of_row(row: Mapping[str, Any]) -> RolloutIdentity | None:
    """The rollout a dispatched row names (None when it names none)."""
    attempt = _count(row, ATTEMPT_INDEX) or 0
    explicit = row.get(ROLLOUT_ID)
    if explicit is not None:
        if not isinstance(explicit, str):
            raise InvalidRequest(f"{ROLLOUT_ID} must be a string, got {explicit!r}")
        return known_identity(explicit, attempt)
    task, rollout = _count(row, TASK_INDEX), _count(row, ROLLOUT_INDEX)
    if task is None and rollout is None:
        return None
    if task is None or rollout is None:
        raise InvalidRequest(f"a row names its rollout with both {TASK_INDEX} and {ROLLOUT_INDEX}")
    return known_identity(f"{task}-{rollout}", attempt)


def identity_of_episode_id(episode_id: Any) -> RolloutIdentity:
    """NeMo Gym's ``EpisodeId`` ``{rollout_id, attempt?}`` as an identity (``InvalidRequest`` if malformed)."""
    if not isinstance(episode_id, dict) or not episode_id.keys() <= _EPISODE_ID_KEYS:
        raise InvalidRequest("episode_id must be an object {rollout_id, attempt}")
    rollout_id = episode_id.get("rollout_id")
    if not isinstance(rollout_id, str):
        raise InvalidRequest("episode_id.rollout_id must be a string")
    attempt = episode_id.get("attempt", 0)
    if type(attempt) is not int or not 0 <= attempt <= _MAX_ATTEMPT:
        raise InvalidRequest(f"episode_id.attempt must be an integer from 0 to {_MAX_ATTEMPT}")
    return known_identity(rollout_id, attempt)


def identities_of_episode_ids(items: Iterable[Any]) -> list[RolloutIdentity]:
    """Each item read as ``identity_of_episode_id`` reads it (raising the same ``InvalidRequest``),
    for a scope of thousands: an item that names an identity made here before, with no other key,
    costs one lookup (``known_identity`` holds only identities that passed their checks)."""
    known = _KNOWN.get
    read: list[RolloutIdentity] = []
    for item in items:
        identity = None
        if type(item) is dict:
            rollout_id, attempt = item.get("rollout_id"), item.get("attempt", 0)
            if type(rollout_id) is str and type(attempt) is int and len(item) == 1 + ("attempt" in item):
                identity = known((rollout_id, attempt))
        read.append(identity if identity is not None else identity_of_episode_id(item))
    return read


def request_identity(named: RolloutIdentity | None) -> RolloutIdentity | None:
    """The request's identity: its ``/ng-rollout/`` prefix and the one its body names, which must agree."""
    prefixed = current_identity()
    if prefixed is not None and named is not None and prefixed != named:
        raise InvalidRequest(f"the /ng-rollout/ prefix names {prefixed.capture_key}, the body names "
                             f"{named.capture_key}")
    return prefixed or named


@contextmanager
def serving_as(identity: RolloutIdentity | None) -> Iterator[None]:
    """While inside, ``identity`` is the request's current identity (as a rollout prefix would set it),
    so the calls made for the request carry it; ``None`` leaves the current one as it is."""
    if identity is None:
        yield
        return
    token = CURRENT_IDENTITY.set(identity)
    try:
        yield
    finally:
        CURRENT_IDENTITY.reset(token)


def without_dispatch_keys(row: Mapping[str, Any]) -> dict[str, Any]:
    """The task row without the keys a collector adds per dispatch."""
    return {key: value for key, value in row.items() if key not in DISPATCH_KEYS}


def naming_the_attempt(row: Mapping[str, Any], identity: RolloutIdentity) -> dict[str, Any]:
    """A row that keeps the collector's task and rollout index, with ``_ng_rollout_id`` and
    ``_ng_attempt_index`` naming ``identity``: what an environment sends on to its resources server
    under that identity's prefix (the two agree; NeMo Gym's verifiers read the indexes)."""
    if TASK_INDEX not in row and ROLLOUT_INDEX not in row:
        return dict(row)
    return {**row, ROLLOUT_ID: identity.rollout_id, ATTEMPT_INDEX: identity.attempt}


def without_attempt_keys(row: Mapping[str, Any]) -> dict[str, Any]:
    """The task row without the keys that name the rollout's attempt (``_ng_attempt_index``,
    ``_ng_rollout_id``): ``_ng_task_index`` and ``_ng_rollout_index`` stay, as in the row NeMo Gym's
    collector sends, whose verifiers read them (genrm_compare's cohort is keyed by them)."""
    return {key: value for key, value in row.items() if key not in (ATTEMPT_INDEX, ROLLOUT_ID)}
