"""Request bodies of the control routes (docs/protocol.md section 3): strict, unknown fields refused.

A body that fails validation is 400 ``invalid_request``. ``checkpoint_id`` is 1-128 characters,
first an ASCII letter or digit, then letters, digits, ``.``, ``_``, ``-``; ``deadline_ts`` is
absolute Unix seconds and finite.
"""

from __future__ import annotations

from typing import TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from nemo_gym_ckpt.errors import InvalidRequest
from nemo_gym_ckpt.identity import RolloutIdentity

__all__ = [
    "CHECKPOINT_ID_PATTERN",
    "CommitRequest",
    "ControlRequest",
    "EpisodeId",
    "ForgetRequest",
    "RestoreRequest",
    "RetireRequest",
    "parse_body",
]

CHECKPOINT_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
MAX_ATTEMPT = 999_999_999


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


M = TypeVar("M", bound=_Body)


class EpisodeId(_Body):
    rollout_id: str = Field(min_length=1, max_length=200)
    attempt: int = Field(0, ge=0, le=MAX_ATTEMPT)

    def identity(self) -> RolloutIdentity:
        return RolloutIdentity(self.rollout_id, self.attempt)


class ControlRequest(_Body):
    """Every POST: prepare, renew and resume carry only these."""

    checkpoint_id: str = Field(pattern=CHECKPOINT_ID_PATTERN)
    deadline_ts: float = Field(allow_inf_nan=False)


class _Scoped(ControlRequest):
    episode_ids: list[EpisodeId] | None = None

    def episodes(self) -> list[RolloutIdentity] | None:
        return None if self.episode_ids is None else [episode.identity() for episode in self.episode_ids]


class CommitRequest(_Scoped):
    checkpoint_dir: str = Field(min_length=1, max_length=4096)
    incremental: bool = True  # reference what did not change since the previous commit (section 6.1)


class RestoreRequest(_Scoped):
    checkpoint_dir: str = Field(min_length=1, max_length=4096)
    episode_ids: list[EpisodeId]


class RetireRequest(_Scoped):
    episode_ids: list[EpisodeId] = Field(min_length=1)


class ForgetRequest(ControlRequest):
    rollout_ids: list[str] = Field(min_length=1)


def parse_body(model: type[M], content: bytes) -> M:
    """Validate a JSON body; any failure is ``InvalidRequest`` naming the first few problems."""
    try:
        body = model.model_validate_json(content)
    except ValidationError as error:
        problems = "; ".join(
            f"{'.'.join(str(part) for part in item['loc']) or 'body'}: {item['msg']}"
            for item in error.errors()[:5]
        )
        raise InvalidRequest(problems or "request body failed validation") from None
    if isinstance(body, _Scoped):
        body.episodes()  # rollout ids must be valid identities
    return body
