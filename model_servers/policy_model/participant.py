"""The policy model server as the checkpoint participant of kind ``model`` (PROTOCOL.md section 8).

``mount_policy_participant`` is called only for the server with ``checkpoint_policy: true``; with
the mesh's checkpointing off it mounts nothing and returns ``None`` (the server is a plain one).
With it on, the routes serve through a ``CustodyBackend`` (admission, held replies, the ledger,
see ``custody``) and ``PolicyAdapter`` answers the control plane:

- readiness: blocked by streams that started to be delivered and have not drained; counts of
  active calls, held replies, ledgers and rows;
- export: one record per ledger in scope, ``{episode_id, ledger: [row, ...]}`` (see ``ledger``);
  held calls have no row;
- install: every record checked (fields, lineage), then installed under the next attempt;
- retire: the calls of the retired attempts stopped and awaited, then their ledgers dropped,
  cumulatively (the attempt and every earlier one of its rollout); refused by the participant
  while a checkpoint is open;
- forget: every ledger of those rollouts dropped.

Generation cuts (``generation_cuts: true``) are declared in ``/status`` but not made yet: every
call in flight at a checkpoint is generated again after a restore, as a failed cut would be, and
the commit's ``staging_keys`` is empty. ``ActiveCalls.cut_inventory`` is what a cut will post.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI

from model_servers.policy_model.active_calls import ActiveCalls, CallState
from model_servers.policy_model.backend import Backend
from model_servers.policy_model.custody import Custody, CustodyBackend
from model_servers.policy_model.ledger import LedgerBook
from nemo_gym_ckpt.checkpoint.adapter import ExportItem, Readiness
from nemo_gym_ckpt.checkpoint.clock import SYSTEM_CLOCK, Clock
from nemo_gym_ckpt.checkpoint.mount import mount_checkpointing
from nemo_gym_ckpt.checkpoint.participant import Participant
from nemo_gym_ckpt.checkpoint.records import Record, Scope
from nemo_gym_ckpt.context import ServerContext
from nemo_gym_ckpt.identity import RolloutIdentity

__all__ = ["PolicyAdapter", "PolicyParticipant", "mount_policy_participant"]

logger = logging.getLogger(__name__)


class PolicyAdapter:
    """The ``ParticipantAdapter`` of the policy model: the active calls and the capture ledgers."""

    def __init__(self, calls: ActiveCalls, ledgers: LedgerBook, *, generation_cuts: bool = False) -> None:
        self.calls = calls
        self.ledgers = ledgers
        self.generation_cuts = generation_cuts

    def counts(self) -> dict[str, int]:
        return {
            "active_calls": len(self.calls),
            "held_responses": self.calls.count(CallState.HELD),
            "delivering_streams": self.calls.count(CallState.DELIVERING),
            "ledgers": len(self.ledgers),
            "rows": self.ledgers.row_count,
        }

    async def readiness(self) -> Readiness:
        return Readiness(blockers=self.calls.delivering_keys(), counts=self.counts())

    async def export(self, scope: Scope | None) -> AsyncIterator[ExportItem]:
        for item in self.ledgers.records(scope):
            yield item

    async def committed(self, scope: Scope | None) -> Mapping[str, Any]:
        self.ledgers.drop_restored_outside(scope)
        return {"staging_keys": []}

    async def install(self, records: Sequence[Record], scope: Scope) -> None:
        self.ledgers.install(records)

    async def retire(self, episodes: Sequence[RolloutIdentity]) -> None:
        await self.calls.wait_closed(self.calls.stop(episodes))
        self.ledgers.retire(episodes)

    async def forget(self, rollout_ids: Sequence[str]) -> None:
        self.ledgers.forget(rollout_ids)

    def status_extras(self) -> Mapping[str, Any]:
        return {"checkpoint_policy": True, "generation_cuts": self.generation_cuts, **self.counts()}


@dataclass
class PolicyParticipant:
    """What mounting made: the participant, its adapter and the backend the routes must use."""

    participant: Participant
    adapter: PolicyAdapter
    backend: CustodyBackend


def mount_policy_participant(
    app: FastAPI,
    ctx: ServerContext[Any],
    backend: Backend,
    *,
    generation_cuts: bool = False,
    clock: Clock = SYSTEM_CLOCK,
) -> PolicyParticipant | None:
    """Mount the model participant on ``app`` (``None``, nothing mounted, with checkpointing off)."""
    calls, ledgers = ActiveCalls(), LedgerBook()
    adapter = PolicyAdapter(calls, ledgers, generation_cuts=generation_cuts)
    participant = mount_checkpointing(app, ctx, adapter, kind="model", clock=clock)
    if participant is None:
        return None
    if generation_cuts:
        logger.warning("generation_cuts is on but cuts are not made yet: calls in flight at a checkpoint "
                       "are generated again after a restore")
    custody = Custody(participant, calls, ledgers)
    return PolicyParticipant(participant, adapter, CustodyBackend(backend, custody))
