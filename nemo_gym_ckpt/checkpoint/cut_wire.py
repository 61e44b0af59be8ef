"""The generation-cut wire, field for field as upstream NeMo Gym and NeMo RL speak it (docs/protocol.md section 8).

A policy model server posts an inventory of the calls it is serving to its backend's
``/ng-control/v1/generation-cut``; the backend (our inference worker, or a NeMo RL-hosted engine)
freezes each call's generated prefix, makes it durable, and answers a receipt:

- request ``GenerationCutInventory``: ``{checkpoint_id, server_name, active_prefixes:
  [{ticket_id, rollout_id, attempt, model_call_id, admitted_at}], inventory_digest}``, the prefixes
  sorted by ``ticket_id``;
- ``inventory_digest`` (``inventory_digest``): lowercase hex SHA-256 of
  ``json.dumps({"checkpoint_id", "server_name", "active_prefixes": [prefix, ...sorted by ticket_id]},
  sort_keys=True, separators=(",", ":"))`` with Python's ``json`` (ASCII escapes, floats as
  ``repr``: an ``admitted_at`` of 1700000000 is written ``1700000000.0``);
- reply ``GenerationCutReceipt``: ``{checkpoint_id, cut_id, inventory_digest, inventory (the request,
  equal field for field), backend_snapshot_id, prefixes: [ack, ...]}``, one ack per ticket, each
  repeating the ticket's five fields, then ``disposition`` (``durable_prefix`` or
  ``durable_failure``), ``cut_kind``, ``frozen_buffer_id``, ``staging_keys``, ``prefix_token_count``,
  ``prefix_digest``, ``effective_output_limit`` (the call's whole output budget, at least 1),
  ``terminal_finish_reason`` and ``terminal_stop_reason``; a failure carries none of the evidence
  (nulls, ``staging_keys: []``).

Both sides use these models: unknown fields are refused; ``GenerationCutReceipt.validate_for`` is
the check a requester makes before trusting a receipt. Stricter than upstream, and said so in
docs/protocol.md: every string and list is bounded, ``checkpoint_id`` follows the control-plane
pattern, ``rollout_id`` the rollout-id rules, ``attempt`` is at most 999,999,999, ``admitted_at``
is finite, and ticket ids in one inventory are unique.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from nemo_gym_ckpt.checkpoint.models import CHECKPOINT_ID_PATTERN, MAX_ATTEMPT, MAX_LIST_ITEMS, RolloutId

__all__ = [
    "CUT_ROUTE",
    "DIGEST_PATTERN",
    "GenerationCutInventory",
    "GenerationCutPrefix",
    "GenerationCutPrefixAck",
    "GenerationCutReceipt",
    "control_root",
    "inventory_digest",
]

CUT_ROUTE = "/ng-control/v1/generation-cut"
DIGEST_PATTERN = r"^[0-9a-f]{64}$"
MAX_NAME = 256
MAX_STAGING_KEYS = 64
MAX_TOKENS = 1_000_000_000
MAX_SECONDS = 1e15  # admitted_at: any clock's seconds (upstream bounds none; infinities and NaN are refused)

Name = Annotated[str, Field(min_length=1, max_length=MAX_NAME)]
Digest = Annotated[str, Field(pattern=DIGEST_PATTERN)]
CheckpointId = Annotated[str, Field(min_length=1, max_length=128, pattern=CHECKPOINT_ID_PATTERN)]


class _Wire(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class GenerationCutPrefix(_Wire):
    """One admitted call whose generated prefix the backend should make durable."""

    ticket_id: Name
    rollout_id: RolloutId
    attempt: int = Field(ge=0, le=MAX_ATTEMPT)
    model_call_id: Name
    admitted_at: float = Field(ge=-MAX_SECONDS, le=MAX_SECONDS, allow_inf_nan=False)


def inventory_digest(checkpoint_id: str, server_name: str, prefixes: Sequence[GenerationCutPrefix]) -> str:
    """Upstream's digest of an inventory (module docstring): order-free in ``prefixes``."""
    ordered = sorted(prefixes, key=lambda prefix: prefix.ticket_id)
    payload = {"checkpoint_id": checkpoint_id, "server_name": server_name,
               "active_prefixes": [prefix.model_dump(mode="json") for prefix in ordered]}
    return hashlib.sha256(json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


class GenerationCutInventory(_Wire):
    """The request body: the calls one backend must cut, bound to one checkpoint by the digest."""

    checkpoint_id: CheckpointId
    server_name: Name
    active_prefixes: list[GenerationCutPrefix] = Field(default_factory=list, max_length=MAX_LIST_ITEMS)
    inventory_digest: Digest

    @model_validator(mode="after")
    def _unique_tickets(self) -> GenerationCutInventory:
        tickets = [prefix.ticket_id for prefix in self.active_prefixes]
        if len(tickets) != len(set(tickets)):
            raise ValueError("ticket_id must be unique within an inventory")
        return self

    @classmethod
    def build(
        cls, checkpoint_id: str, server_name: str, prefixes: Sequence[GenerationCutPrefix]
    ) -> GenerationCutInventory:
        """The inventory of ``prefixes`` (sorted by ticket) with its digest, as upstream builds it."""
        ordered = sorted(prefixes, key=lambda prefix: prefix.ticket_id)
        return cls(checkpoint_id=checkpoint_id, server_name=server_name, active_prefixes=ordered,
                   inventory_digest=inventory_digest(checkpoint_id, server_name, ordered))

    def expected_digest(self) -> str:
        return inventory_digest(self.checkpoint_id, self.server_name, self.active_prefixes)


class GenerationCutPrefixAck(_Wire):
    """The backend's durable outcome for one ticket."""

    ticket_id: Name
    rollout_id: RolloutId
    attempt: int = Field(ge=0, le=MAX_ATTEMPT)
    model_call_id: Name
    admitted_at: float = Field(ge=-MAX_SECONDS, le=MAX_SECONDS, allow_inf_nan=False)
    disposition: Literal["durable_prefix", "durable_failure"]
    cut_kind: Literal["active_prefix", "terminal_completion"] | None = None
    frozen_buffer_id: Name | None = None
    staging_keys: list[Annotated[str, Field(min_length=1, max_length=1024)]] = Field(
        default_factory=list, max_length=MAX_STAGING_KEYS)
    prefix_token_count: int | None = Field(None, ge=0, le=MAX_TOKENS)
    prefix_digest: Digest | None = None
    effective_output_limit: int | None = Field(None, ge=1, le=MAX_TOKENS)
    terminal_finish_reason: Literal["stop", "length"] | None = None
    terminal_stop_reason: Annotated[str, Field(max_length=MAX_NAME)] | int | None = None

    @model_validator(mode="after")
    def _evidence_matches_the_disposition(self) -> GenerationCutPrefixAck:
        evidence = (self.cut_kind, self.frozen_buffer_id, self.prefix_token_count, self.prefix_digest)
        if self.disposition == "durable_prefix":
            missing = any(value is None for value in evidence) or self.effective_output_limit is None
            if missing or not self.staging_keys:
                raise ValueError("durable_prefix requires cut_kind, frozen_buffer_id, staging_keys, "
                                 "prefix_token_count, prefix_digest and effective_output_limit")
        elif any(value is not None for value in evidence) or self.staging_keys or self.effective_output_limit:
            raise ValueError("durable_failure cannot carry prefix evidence")
        if self.terminal_stop_reason is not None and self.terminal_finish_reason is None:
            raise ValueError("terminal_stop_reason requires terminal_finish_reason")
        if len(self.staging_keys) != len(set(self.staging_keys)):
            raise ValueError("staging_keys must be unique")
        return self

    @classmethod
    def failure(cls, prefix: GenerationCutPrefix) -> GenerationCutPrefixAck:
        return cls(**prefix.model_dump(), disposition="durable_failure")

    def identity(self) -> tuple[str, int, str, float]:
        return self.rollout_id, self.attempt, self.model_call_id, self.admitted_at


class GenerationCutReceipt(_Wire):
    """The reply: a durable answer for every ticket of the inventory it repeats."""

    checkpoint_id: CheckpointId
    cut_id: Name
    inventory_digest: Digest
    inventory: GenerationCutInventory
    backend_snapshot_id: Name
    prefixes: list[GenerationCutPrefixAck] = Field(default_factory=list, max_length=MAX_LIST_ITEMS)

    def validate_for(self, inventory: GenerationCutInventory) -> None:
        """``ValueError`` unless this receipt answers exactly ``inventory``: the same inventory and
        digest, every ticket once, each ack repeating its ticket's identity."""
        if self.inventory != inventory or self.inventory_digest != inventory.inventory_digest:
            raise ValueError("the generation-cut receipt answers a different inventory")
        admitted = {prefix.ticket_id: prefix for prefix in inventory.active_prefixes}
        acked = [ack.ticket_id for ack in self.prefixes]
        if len(acked) != len(set(acked)) or set(acked) != set(admitted):
            raise ValueError("the generation-cut receipt must answer every ticket of the inventory exactly once")
        for ack in self.prefixes:
            call = admitted[ack.ticket_id]
            if ack.identity() != (call.rollout_id, call.attempt, call.model_call_id, call.admitted_at):
                raise ValueError(f"the generation-cut receipt names another call for ticket {ack.ticket_id!r}")


def control_root(base_url: str) -> str:
    """Where a backend serves its control routes by default: its URL without a trailing ``/v1``."""
    return base_url.rstrip("/").removesuffix("/v1")
