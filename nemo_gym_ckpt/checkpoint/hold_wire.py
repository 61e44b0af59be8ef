"""The generation-hold wire between the policy model and its inference worker (docs/protocol.md section 8.4).

This project's own routes (upstream has none): while a checkpoint is open the policy model asks the
worker to take no decode steps, and releases it at the resume.

- ``POST /ng-control/v1/generation-hold``, ``HoldRequest`` ``{checkpoint_id, seconds}``: hold for at
  most ``seconds`` (``0 < seconds <= MAX_HOLD_S``);
- ``POST /ng-control/v1/generation-hold/release``, ``ReleaseRequest`` ``{checkpoint_id}``;
- ``GET /ng-control/v1/generation-hold``: the worker's hold status.

Both bodies are strict: unknown fields, a string for a number and an empty or overlong id are
refused (400 ``invalid_request``).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["HOLD_ROUTE", "MAX_HOLD_S", "HoldRequest", "ReleaseRequest"]

HOLD_ROUTE = "/ng-control/v1/generation-hold"
MAX_HOLD_S = 120.0


class ReleaseRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    checkpoint_id: str = Field(min_length=1, max_length=256)


class HoldRequest(ReleaseRequest):
    seconds: float = Field(gt=0, le=MAX_HOLD_S)
