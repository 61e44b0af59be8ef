"""Wire bodies of generation cuts (docs/protocol.md section 8): what the policy model sends the worker.

On ``POST /v1/completions`` (checkpointing on only):

- ``model_call: {model_call_id, parent_call_id, previous_length, constrained}`` names the
  generation for cuts: the policy model's call id, its lineage when it was admitted (the previous
  delivered call of the rollout and how many calls the rollout's ledger held) and whether it uses
  constrained decoding (never cut). The rollout comes from the ``/ng-rollout/<key>/`` prefix.
- ``continuation: {staging_keys, source_call_id, prefix_token_count, prefix_digest,
  effective_output_limit}`` asks to continue a staged prefix instead of starting afresh (it needs
  ``model_call``).

On ``POST /ng-control/v1/generation-cut``: upstream's ``GenerationCutInventory``
(``nemo_gym_ckpt.checkpoint.cut_wire``; ``CutRequest`` and ``ActivePrefix`` here are its names in the
worker); on ``.../generation-cut/keep``: ``KeepRequest`` (this project's settling of a cut). Bodies
reject unknown fields; a bad body is 400 ``invalid_request``.
"""

from __future__ import annotations

from typing import Annotated, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from model_servers.inference_worker.staging import CALL_ID_PATTERN
from nemo_gym_ckpt.checkpoint.cut_wire import MAX_TOKENS, GenerationCutInventory, GenerationCutPrefix
from nemo_gym_ckpt.checkpoint.models import CHECKPOINT_ID_PATTERN
from nemo_gym_ckpt.errors import InvalidRequest

__all__ = [
    "MAX_PREFIXES",
    "ActivePrefix",
    "ContinuationRef",
    "CutRequest",
    "KeepRequest",
    "ModelCall",
    "parse_strict",
]

MAX_PREFIXES = 100_000
M = TypeVar("M", bound=BaseModel)
_DIGEST = r"^[0-9a-f]{64}$"


StagingKey = Annotated[str, Field(min_length=1, max_length=1024)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelCall(_Body):
    model_call_id: str = Field(pattern=CALL_ID_PATTERN)
    parent_call_id: str | None = Field(None, pattern=CALL_ID_PATTERN)
    previous_length: int = Field(0, ge=0, le=MAX_TOKENS)
    constrained: bool = False


class ContinuationRef(_Body):
    staging_keys: list[StagingKey] = Field(min_length=1, max_length=1)
    source_call_id: str = Field(pattern=CALL_ID_PATTERN)
    prefix_token_count: int = Field(ge=1, le=MAX_TOKENS)
    prefix_digest: str = Field(pattern=_DIGEST)
    effective_output_limit: int = Field(ge=1, le=MAX_TOKENS)  # the call's whole output budget


ActivePrefix = GenerationCutPrefix
CutRequest = GenerationCutInventory


class KeepRequest(_Body):
    checkpoint_id: str = Field(pattern=CHECKPOINT_ID_PATTERN)
    server_name: str = Field(min_length=1, max_length=256)
    staging_keys: list[StagingKey] = Field(max_length=MAX_PREFIXES)


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
