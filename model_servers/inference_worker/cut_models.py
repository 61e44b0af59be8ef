"""Wire bodies of generation cuts (docs/protocol.md section 8): what the policy model sends the worker.

On ``POST /v1/completions`` (checkpointing on only):

- ``model_call: {model_call_id, parent_call_id, previous_length, constrained}`` names the
  generation for cuts: the policy model's call id, its lineage when it was admitted (the previous
  delivered call of the rollout and how many calls the rollout's ledger held) and whether it uses
  constrained decoding (never cut). The rollout comes from the ``/ng-rollout/<key>/`` prefix.
- ``continuation: {staging_keys, source_call_id, prefix_token_count, prefix_digest,
  effective_output_limit}`` asks to continue a staged prefix instead of starting afresh (it needs
  ``model_call``).

On ``POST /ng-control/v1/generation-cut``: ``CutRequest``; on ``.../generation-cut/keep``:
``KeepRequest``. Bodies reject unknown fields; a bad body is 400 ``invalid_request``.
"""

from __future__ import annotations

import hashlib
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from model_servers.inference_worker.staging import CALL_ID_PATTERN
from nemo_gym_ckpt.canonical import canonical_json
from nemo_gym_ckpt.checkpoint.models import CHECKPOINT_ID_PATTERN
from nemo_gym_ckpt.errors import InvalidRequest

__all__ = [
    "MAX_PREFIXES",
    "ActivePrefix",
    "ContinuationRef",
    "CutRequest",
    "KeepRequest",
    "ModelCall",
    "inventory_digest",
    "parse_strict",
]

MAX_PREFIXES = 100_000
M = TypeVar("M", bound=BaseModel)
_DIGEST = r"^[0-9a-f]{64}$"
_SERVER = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelCall(_Body):
    model_call_id: str = Field(pattern=CALL_ID_PATTERN)
    parent_call_id: str | None = Field(None, pattern=CALL_ID_PATTERN)
    previous_length: int = Field(0, ge=0)
    constrained: bool = False


class ContinuationRef(_Body):
    staging_keys: list[str] = Field(min_length=1, max_length=1)
    source_call_id: str = Field(pattern=CALL_ID_PATTERN)
    prefix_token_count: int = Field(ge=1)
    prefix_digest: str = Field(pattern=_DIGEST)
    effective_output_limit: int = Field(ge=0)


class ActivePrefix(_Body):
    ticket_id: str = Field(min_length=1, max_length=200)
    rollout_id: str = Field(min_length=1, max_length=200)
    attempt: int = Field(ge=0)
    model_call_id: str = Field(pattern=CALL_ID_PATTERN)
    admitted_at: float = Field(allow_inf_nan=False)


class CutRequest(_Body):
    checkpoint_id: str = Field(pattern=CHECKPOINT_ID_PATTERN)
    server_name: str = Field(pattern=_SERVER)
    active_prefixes: list[ActivePrefix] = Field(max_length=MAX_PREFIXES)
    inventory_digest: str = Field(pattern=_DIGEST)


class KeepRequest(_Body):
    checkpoint_id: str = Field(pattern=CHECKPOINT_ID_PATTERN)
    server_name: str = Field(pattern=_SERVER)
    staging_keys: list[str] = Field(max_length=MAX_PREFIXES)


def inventory_digest(active_prefixes: list[dict[str, Any]]) -> str:
    """SHA-256 of the ``active_prefixes`` list as compact JSON with sorted keys."""
    return hashlib.sha256(canonical_json(active_prefixes)).hexdigest()


def parse_strict(model: type[M], content: bytes) -> M:
    """Validate a JSON body; a failure is ``InvalidRequest`` naming the first few problems."""
    try:
        return model.model_validate_json(content)
    except ValidationError as error:
        problems = "; ".join(
            f"{'.'.join(str(part) for part in item['loc']) or 'body'}: {item['msg']}"
            for item in error.errors()[:5]
        )
        raise InvalidRequest(problems or "request body failed validation") from None
