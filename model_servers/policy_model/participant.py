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

Generation cuts (``generation_cuts: true``, see ``cuts``): at commit, before the export
(``before_export``, which gets the commit's deadline), the calls in flight are cut on the worker;
each durable cut goes into its episode's record; ``committed`` settles the cut with the worker and
answers the kept ``staging_keys`` (those of every exported record, restored cuts included).
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
from model_servers.policy_model.cuts import CutClient, CutRecord, GenerationCutter
from model_servers.policy_model.ledger import CUT_KEY, LedgerBook
from nemo_gym_ckpt.checkpoint.adapter import ExportItem, Readiness
from nemo_gym_ckpt.checkpoint.clock import SYSTEM_CLOCK, Clock
from nemo_gym_ckpt.checkpoint.mount import mount_checkpointing
from nemo_gym_ckpt.checkpoint.participant import Participant
from nemo_gym_ckpt.checkpoint.records import Record, Scope
from nemo_gym_ckpt.context import ServerContext
from nemo_gym_ckpt.identity import RolloutIdentity

__all__ = ["PolicyAdapter", "PolicyParticipant", "kept_staging_keys", "mount_policy_participant"]

logger = logging.getLogger(__name__)


class PolicyAdapter:
    """The ``ParticipantAdapter`` of the policy model: the active calls and the capture ledgers."""

    def __init__(
        self, calls: ActiveCalls, ledgers: LedgerBook, *, generation_cuts: bool = False,
        cutter: GenerationCutter | None = None,
    ) -> None:
        self.calls = calls
        self.ledgers = ledgers
        self.generation_cuts = generation_cuts
        self.cutter = cutter
        self._commit: tuple[str, float] | None = None  # (checkpoint id, deadline) of the commit running
        self._cuts: dict[RolloutIdentity, CutRecord] = {}
        self._kept: list[str] = []

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

    async def before_export(self, checkpoint_id: str, scope: Scope | None, deadline_ts: float) -> None:
        """Cut the calls in flight (never fails: a failed cut leaves those calls to be generated again)."""
        self._commit, self._cuts = (checkpoint_id, deadline_ts), {}
        if self.cutter is not None:
            self._cuts = await self.cutter.cut(checkpoint_id, scope, deadline_ts, self.ledgers.lineage)

    async def export(self, scope: Scope | None) -> AsyncIterator[ExportItem]:
        items = self.ledgers.records(scope, self._cuts)
        self._kept = kept_staging_keys(items)
        for item in items:
            yield item

    async def committed(self, scope: Scope | None) -> Mapping[str, Any]:
        self.ledgers.drop_restored_outside(scope)
        kept, commit = sorted(set(self._kept)), self._commit
        self._commit, self._cuts, self._kept = None, {}, []
        if self.cutter is not None and commit is not None:
            await self.cutter.settle(commit[0], kept, commit[1])
        return {"staging_keys": kept}

    async def install(self, records: Sequence[Record], scope: Scope) -> None:
        self.ledgers.install(records)

    async def retire(self, episodes: Sequence[RolloutIdentity]) -> None:
        await self.calls.wait_closed(self.calls.stop(episodes))
        self.ledgers.retire(episodes)

    async def forget(self, rollout_ids: Sequence[str]) -> None:
        self.ledgers.forget(rollout_ids)

    def status_extras(self) -> Mapping[str, Any]:
        return {"checkpoint_policy": True, "generation_cuts": self.generation_cuts, **self.counts()}


def kept_staging_keys(items: Sequence[ExportItem]) -> list[str]:
    """The staging keys the cuts of exported records name."""
    keys: list[str] = []
    for item in items:
        data = item.data if isinstance(item, Record) else item
        cut = data.get(CUT_KEY)
        if isinstance(cut, dict):
            keys.extend(cut["staging_keys"])
    return keys


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
    worker_url: str | None = None,
    generation_cuts: bool = False,
    clock: Clock = SYSTEM_CLOCK,
) -> PolicyParticipant | None:
    """Mount the model participant on ``app`` (``None``, nothing mounted, with checkpointing off).

    With ``generation_cuts``, ``worker_url`` is the inference worker the cuts are posted to.
    """
    calls, ledgers = ActiveCalls(), LedgerBook()
    adapter = PolicyAdapter(calls, ledgers, generation_cuts=generation_cuts)
    participant = mount_checkpointing(app, ctx, adapter, kind="model", clock=clock)
    if participant is None:
        return None
    if generation_cuts:
        if worker_url is None:
            raise ValueError("generation cuts need the inference worker's url")
        token = ctx.mesh.checkpoint.control_auth_token
        assert token is not None  # the config refuses checkpointing without a token
        client = CutClient(ctx.client, worker_url, token.get_secret_value(), ctx.name)
        adapter.cutter = GenerationCutter(calls, client, participant.clock, participant.telemetry)
    custody = Custody(participant, calls, ledgers, generation_cuts=generation_cuts)
    return PolicyParticipant(participant, adapter, CustodyBackend(backend, custody))
