"""One exported record: a JSON object of one episode (or one session of an episode).

Every record names its episode in ``episode_id: {rollout_id, attempt}``; that is how a commit or a
restore keeps only the records in its scope. A ``Record`` keeps the exact bytes it was read from,
so content restored and not changed is exported again byte for byte (an adapter yields the same
``Record`` back). Token arrays never appear in records: a record carrying one of
``TOKEN_ARRAY_KEYS`` is refused when it is encoded or read. The check looks at the bytes first
(``_may_hold_token_arrays``): only a record whose bytes could hold such a key is walked, so the
common record costs a few substring searches instead of a walk over every value.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson

from nemo_gym_ckpt.capture import RECORD_FORBIDDEN_KEYS
from nemo_gym_ckpt.errors import GymError, InternalError, InvalidCheckpointState
from nemo_gym_ckpt.identity import RolloutIdentity, known_identity

__all__ = ["PATCH_KEY", "REFERENCE_KEYS", "SPAN_KEY", "TOKEN_ARRAY_KEYS", "Record", "Scope", "episode_of",
           "is_reference", "scope_of"]

Scope = frozenset[RolloutIdentity]

TOKEN_ARRAY_KEYS = RECORD_FORBIDDEN_KEYS
SPAN_KEY = "same_as"
PATCH_KEY = "patch_of"
REFERENCE_KEYS = (SPAN_KEY, PATCH_KEY)
"""The keys that mark a line of an incremental checkpoint as a reference (a span, a patch) rather
than a record (docs/protocol.md section 6.1); no record an adapter exports may carry one."""
_TOKEN_KEYS = frozenset(TOKEN_ARRAY_KEYS)
_ALL_MARKS = {f'{key}"'.encode() for key in TOKEN_ARRAY_KEYS}
_KEY_MARKS = tuple(sorted(mark for mark in _ALL_MARKS if not any(other != mark and mark.endswith(other)
                                                               for other in _ALL_MARKS)))
"""The marks to search for: one that ends with another is found by that one (``token_ids"`` finds
``prompt_token_ids"``), so each record's bytes are scanned fewer times."""


@dataclass(frozen=True, slots=True)
class Record:
    """A record's exact JSON bytes (no newline), its parsed object and its episode; ``reference``
    (known when it is made) tells whether it is a span or a patch line (``REFERENCE_KEYS``), so a
    commit's check of every record it writes reads one attribute."""

    raw: bytes
    data: dict[str, Any]
    episode: RolloutIdentity
    reference: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "reference", SPAN_KEY in self.data or PATCH_KEY in self.data)

    @classmethod
    def from_data(cls, data: Mapping[str, Any]) -> Record:
        """Encode a record an adapter exported (key order kept); a malformed one is a bug."""
        try:
            raw = orjson.dumps(data)
            episode = episode_of(data)
        except (TypeError, GymError) as error:
            raise InternalError(f"adapter exported an unusable record: {error}") from error
        if _may_hold_token_arrays(raw):
            _refuse_token_arrays(data, InternalError)
        return cls(raw, data if isinstance(data, dict) else dict(data), episode)

    @classmethod
    def of_strings(cls, episode: RolloutIdentity, **fields: str) -> Record:
        """``{episode_id, **fields}`` with string values under keys the caller's code names: no token
        array can be in it, so it is encoded without ``from_data``'s checks (a session's id)."""
        data: dict[str, Any] = {"episode_id": episode.to_json(), **fields}
        return cls(orjson.dumps(data), data, episode)

    @classmethod
    def from_raw(cls, raw: bytes) -> Record:
        """Parse one line of a records file; anything malformed is ``InvalidCheckpointState``."""
        try:
            data = orjson.loads(raw)
        except orjson.JSONDecodeError as error:
            raise InvalidCheckpointState(f"a record is not valid JSON: {error}") from None
        if not isinstance(data, dict):
            raise InvalidCheckpointState("a record is not a JSON object")
        if _may_hold_token_arrays(raw):
            _refuse_token_arrays(data, InvalidCheckpointState)
        try:
            return cls(raw, data, episode_of(data))
        except GymError as error:
            raise InvalidCheckpointState(f"a record has no valid episode_id: {error.detail}") from None


def is_reference(record: Record) -> bool:
    """A span or a patch line, not a record (``REFERENCE_KEYS``)."""
    return record.reference


def episode_of(data: Mapping[str, Any]) -> RolloutIdentity:
    """The ``episode_id`` of a record (``InvalidCheckpointState`` when missing or malformed)."""
    episode = data.get("episode_id")
    if not isinstance(episode, dict) or len(episode) != 2:
        raise InvalidCheckpointState("episode_id must be {rollout_id, attempt}")
    rollout_id, attempt = episode.get("rollout_id"), episode.get("attempt")
    if not isinstance(rollout_id, str) or type(attempt) is not int:
        raise InvalidCheckpointState("episode_id must be {rollout_id: str, attempt: int}")
    return known_identity(rollout_id, attempt)


def scope_of(episodes: list[RolloutIdentity] | None) -> Scope | None:
    return None if episodes is None else frozenset(episodes)


def _may_hold_token_arrays(raw: bytes) -> bool:
    """Whether JSON bytes may hold a forbidden key; ``False`` proves they hold none.

    A key is written ``"name"`` (then optional whitespace and ``:``), so its bytes hold ``name"``;
    inside a string every quote is escaped (``\\"``), so string text never does. Only a ``\\u``
    escape could spell a key otherwise (orjson writes none in keys; a file read back may)."""
    for mark in _KEY_MARKS:  # a loop, not any() over a generator: this runs for every record
        if mark in raw:
            return True
    return b"\\u" in raw


def _refuse_token_arrays(data: Any, error: type[GymError]) -> None:
    """Walk the containers of a record (never the text of its strings) for a token-array key."""
    stack = [data]
    while stack:
        value = stack.pop()
        if isinstance(value, dict):
            found = _TOKEN_KEYS.intersection(value)
            if found:
                raise error(f"records never carry token arrays; found {sorted(found)[0]!r}")
            stack.extend(item for item in value.values() if isinstance(item, dict | list))
        elif isinstance(value, list):
            stack.extend(item for item in value if isinstance(item, dict | list))
