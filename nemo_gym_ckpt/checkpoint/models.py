"""Request bodies of the control routes (docs/protocol.md section 3): strict, every field bounded.

A body that fails validation is 400 ``invalid_request``. ``checkpoint_id`` is 1-128 characters,
first an ASCII letter or digit, then letters, digits, ``.``, ``_``, ``-``; ``deadline_ts`` is
absolute Unix seconds and finite (how far ahead it may be is the participant's check, against its
own clock: ``checkpoint.max_deadline_seconds``). Rollout ids follow ``nemo_gym_ckpt.identity``;
every list holds at most ``MAX_LIST_ITEMS`` entries and every string has a length bound, so no
body can make a participant hold more than the body's own (bounded) size.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, TypeVar

import orjson
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, PlainValidator, ValidationError, WithJsonSchema

from nemo_gym_ckpt.errors import InvalidRequest
from nemo_gym_ckpt.identity import (
    MAX_ATTEMPT,
    MAX_ROLLOUT_ID_LENGTH,
    ROLLOUT_ID_PATTERN,
    RolloutIdentity,
    identities_of_episode_ids,
    identity_of_episode_id,
    rollout_id_problem,
)

__all__ = [
    "CHECKPOINT_ID_PATTERN",
    "MAX_ATTEMPT",
    "MAX_CHECKPOINT_DIR_LENGTH",
    "MAX_LIST_ITEMS",
    "CommitRequest",
    "ControlRequest",
    "EpisodeId",
    "ForgetRequest",
    "RestoreRequest",
    "RetireRequest",
    "RolloutId",
    "load_json",
    "parse_body",
    "parse_object",
]

CHECKPOINT_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
MAX_CHECKPOINT_DIR_LENGTH = 4096
MAX_LIST_ITEMS = 100_000
MAX_TIMESTAMP = 1e11  # Unix seconds (year 5138): a wider bound than any deadline the horizon lets through


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


M = TypeVar("M", bound=_Body)


def _valid_rollout_id(value: str) -> str:
    problem = rollout_id_problem(value)
    if problem is not None:
        raise ValueError(problem)
    return value


RolloutId = Annotated[
    str,
    Field(min_length=1, max_length=MAX_ROLLOUT_ID_LENGTH, pattern=ROLLOUT_ID_PATTERN),
    AfterValidator(_valid_rollout_id),
]
"""A rollout id as a body field: the pattern, the length bound and no ``-a<digits>`` ending."""


class EpisodeId(_Body):
    rollout_id: RolloutId
    attempt: int = Field(0, ge=0, le=MAX_ATTEMPT)

    def identity(self) -> RolloutIdentity:
        return RolloutIdentity(self.rollout_id, self.attempt)


class ControlRequest(_Body):
    """Every POST: prepare, renew and resume carry only these."""

    checkpoint_id: str = Field(min_length=1, max_length=128, pattern=CHECKPOINT_ID_PATTERN)
    deadline_ts: float = Field(ge=0, le=MAX_TIMESTAMP, allow_inf_nan=False)


def _episode_list_schema(minimum: int) -> dict[str, Any]:
    item = {"type": "object", "additionalProperties": False, "required": ["rollout_id"], "properties": {
        "rollout_id": {"type": "string", "minLength": 1, "maxLength": MAX_ROLLOUT_ID_LENGTH,
                       "pattern": ROLLOUT_ID_PATTERN},
        "attempt": {"type": "integer", "minimum": 0, "maximum": MAX_ATTEMPT, "default": 0}}}
    return {"type": "array", "items": item, "minItems": minimum, "maxItems": MAX_LIST_ITEMS}


def _identities(minimum: int) -> Callable[[Any], tuple[RolloutIdentity, ...]]:
    """``[{rollout_id, attempt?}, ...]`` read straight into identities, each checked once (what
    ``EpisodeId`` checks): a commit's scope of 4,096 episodes is read by every participant inside the
    pause, and a model instance per entry, then an identity, cost twice as much."""

    def identities(value: Any) -> tuple[RolloutIdentity, ...]:
        if type(value) is not list:
            raise ValueError("must be a list of {rollout_id, attempt} objects")
        if not minimum <= len(value) <= MAX_LIST_ITEMS:
            raise ValueError(f"must hold {minimum} to {MAX_LIST_ITEMS} entries, got {len(value)}")
        try:
            return tuple(identities_of_episode_ids(value))
        except InvalidRequest:
            for number, item in enumerate(value):  # which entry: the message names it
                try:
                    identity_of_episode_id(item)
                except InvalidRequest as error:
                    raise ValueError(f"entry {number}: {error.detail}") from None
            raise

    return identities


EpisodeList = Annotated[Any, PlainValidator(_identities(0)), WithJsonSchema(_episode_list_schema(0))]
"""A scope: a tuple of identities once read (at most ``MAX_LIST_ITEMS``)."""
NonEmptyEpisodeList = Annotated[Any, PlainValidator(_identities(1)), WithJsonSchema(_episode_list_schema(1))]


class _Scoped(ControlRequest):
    episode_ids: EpisodeList | None = None

    def episodes(self) -> list[RolloutIdentity] | None:
        return None if self.episode_ids is None else list(self.episode_ids)


class CommitRequest(_Scoped):
    checkpoint_dir: str = Field(min_length=1, max_length=MAX_CHECKPOINT_DIR_LENGTH)
    stop: bool = False
    """The controller stops this mesh after the commit: once the write is durable the participant
    frees what it holds outside its records (a failure to do so never fails the commit)."""
    incremental: bool = True  # reference what did not change since the previous commit (section 6.1)


class RestoreRequest(_Scoped):
    checkpoint_dir: str = Field(min_length=1, max_length=MAX_CHECKPOINT_DIR_LENGTH)
    episode_ids: EpisodeList


class RetireRequest(_Scoped):
    episode_ids: NonEmptyEpisodeList


class ForgetRequest(ControlRequest):
    rollout_ids: list[RolloutId] = Field(min_length=1, max_length=MAX_LIST_ITEMS)


def parse_body(model: type[M], content: bytes) -> M:
    """Validate a JSON body; any failure is ``InvalidRequest`` naming the first few problems.

    The bytes are read by orjson, then the object validated: a commit's scope of 4,096 entries
    costs about 60% of what pydantic's own JSON reading does (every field here is a JSON type, so
    strict validation accepts and refuses the same bodies either way)."""
    return parse_object(model, load_json(content))


def load_json(content: bytes) -> Any:
    """A body's JSON value; bytes that are not JSON are ``InvalidRequest``."""
    try:
        return orjson.loads(content)
    except orjson.JSONDecodeError as error:
        raise InvalidRequest(f"body: not valid JSON ({error})") from None


def parse_object(model: type[M], data: Any) -> M:
    """Validate a body already read from JSON (``parse_body``'s second half)."""
    try:
        return model.model_validate(data)
    except ValidationError as error:
        raise InvalidRequest(_problems(error.errors()[:5]) or "request body failed validation") from None


def _problems(errors: list[Any]) -> str:
    return "; ".join(f"{'.'.join(str(part) for part in item['loc']) or 'body'}: {item['msg']}" for item in errors)
