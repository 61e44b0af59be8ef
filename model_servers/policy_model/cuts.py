"""Generation cuts on the policy model's side (docs/protocol.md section 8, second half).

At commit, before the export, ``GenerationCutter.cut`` takes per episode in scope the latest
admitted call still generating (``ActiveCalls.cut_candidates``) and posts their inventory, upstream's
``GenerationCutInventory`` (``nemo_gym_ckpt.checkpoint.cut_wire``), to its backend's cut endpoint
with **half of the remaining commit deadline**: ``<control url>/ng-control/v1/generation-cut``,
the control url being the worker's URL without a ``/v1`` suffix unless the server's
``generation_cut_url`` names another (a backend that serves cuts elsewhere, as a NeMo RL-hosted
engine does), over a connection pool of its own, so a cut never queues behind the generations it
cuts. The receipt must answer exactly that inventory (``GenerationCutReceipt.validate_for``), or
every ticket counts as failed. Each ``durable_prefix`` ack becomes a ``CutRecord`` in that
episode's ledger record: coordinates and digests only (staging keys, counts, digests, lineage),
never token arrays. A cut that fails, is
late, or is refused for a ticket never fails the checkpoint: that call is simply generated again
after a restore. A cut whose call's lineage moved since admission (another call of the rollout was
delivered in between) is dropped too: it could not be continued consistently.

After the records are durable, ``settle`` posts the kept staging keys to the worker's
``/ng-control/v1/generation-cut/keep`` (within half of what is left of the deadline): the
checkpoint's other staged prefixes are deleted and the kept ones marked. The keep is sent in the
background and the commit replies without waiting for it, since nothing it promises depends on it: the
records name their staging keys, a staged prefix is only ever deleted by a keep that does not list
it (or evicted when the store is full, kept or not), and a kept mark only orders eviction. A keep
still running when the next cut starts is awaited first (bounded); one that fails or is cut short,
and the cut of a checkpoint that never committed, are settled again before the next cut (an
aborted checkpoint keeps nothing).

On restore, a ledger installed with a cut carries it until the rollout's next delivered call; the
re-issued call whose conversation digest matches the cut's continues from the staged prefix
(``CutRecord.continuation``, attached by ``custody.Custody.as_sent``).
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from model_servers.policy_model.active_calls import ActiveCalls, Ticket
from model_servers.policy_model.generation import CutContinuation
from nemo_gym_ckpt.checkpoint.clock import Clock
from nemo_gym_ckpt.checkpoint.cut_wire import (
    CUT_ROUTE,
    MAX_STAGING_KEYS,
    MAX_TOKENS,
    GenerationCutInventory,
    GenerationCutPrefix,
    GenerationCutPrefixAck,
    GenerationCutReceipt,
)
from nemo_gym_ckpt.checkpoint.records import Scope
from nemo_gym_ckpt.checkpoint.telemetry import ATTR, Telemetry
from nemo_gym_ckpt.client import MeshClient
from nemo_gym_ckpt.errors import GymError, InvalidCheckpointState, NotFound, UpstreamError
from nemo_gym_ckpt.identity import RolloutIdentity

__all__ = ["CUT_FIELDS", "CUT_PATH", "CutClient", "CutRecord", "GenerationCutter", "Lineage", "LineageOf"]

logger = logging.getLogger(__name__)

CUT_PATH = CUT_ROUTE
CANCEL_WAIT_S = 5.0
_DIGEST = re.compile(r"[0-9a-f]{64}")
_CALL_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")
_KEY = re.compile(r"[\x21-\x7e]{1,1024}")  # any printable key: a NeMo RL engine's keys are paths
Lineage = tuple[str | None, int]  # (parent call id, previous length) of a rollout's ledger
LineageOf = Callable[[RolloutIdentity], Lineage]


@dataclass(frozen=True)
class CutRecord:
    """What a ledger record keeps of one cut (``cut`` in the record)."""

    source_call_id: str
    conversation_digest: str
    parent_call_id: str | None
    previous_length: int
    cut_kind: str
    staging_keys: tuple[str, ...]
    prefix_token_count: int
    prefix_digest: str
    effective_output_limit: int
    terminal_finish_reason: str | None

    @property
    def lineage(self) -> Lineage:
        return self.parent_call_id, self.previous_length

    @classmethod
    def of(cls, ticket: Ticket, ack: GenerationCutPrefixAck) -> CutRecord | None:
        """The record of a durable ack (``None`` for a failure or an unusable ack)."""
        if ack.disposition != "durable_prefix" or ack.cut_kind is None or ack.prefix_digest is None:
            return None
        record = cls(ticket.model_call_id, ticket.conversation_digest, ticket.parent_call_id,
                     ticket.previous_length, ack.cut_kind, tuple(ack.staging_keys), ack.prefix_token_count or 0,
                     ack.prefix_digest, ack.effective_output_limit or 0, ack.terminal_finish_reason)
        return record if _valid(record.to_json()) else None

    def to_json(self) -> dict[str, Any]:
        return {name: list(value) if isinstance(value, tuple) else value
                for name, value in zip(CUT_FIELDS, _values(self), strict=True)}

    @classmethod
    def from_json(cls, data: Any, where: str) -> CutRecord:
        """A cut read back from a record; anything malformed is ``InvalidCheckpointState``."""
        if not isinstance(data, dict) or set(data) != set(CUT_FIELDS):
            raise InvalidCheckpointState(f"{where}: a cut must have exactly the fields {list(CUT_FIELDS)}")
        problem = _problem(data)
        if problem is not None:
            raise InvalidCheckpointState(f"{where}: cut field {problem} has an invalid value "
                                         f"{data[problem]!r}")
        return cls(**{**data, "staging_keys": tuple(data["staging_keys"])})

    def continuation(self) -> CutContinuation:
        return CutContinuation(self.staging_keys, self.source_call_id, self.prefix_token_count,
                               self.prefix_digest, self.effective_output_limit)


CUT_FIELDS = tuple(CutRecord.__dataclass_fields__)


def _values(record: CutRecord) -> list[Any]:
    return [getattr(record, name) for name in CUT_FIELDS]


def _count(value: Any) -> bool:
    """A token count as the wire bounds it (``cut_wire.MAX_TOKENS``): a restored record holds no more."""
    return type(value) is int and 0 <= value <= MAX_TOKENS


_CHECKS: dict[str, Callable[[Any], bool]] = {
    "source_call_id": lambda v: isinstance(v, str) and _CALL_ID.fullmatch(v) is not None,
    "conversation_digest": lambda v: isinstance(v, str) and _DIGEST.fullmatch(v) is not None,
    "parent_call_id": lambda v: v is None or (isinstance(v, str) and 0 < len(v) <= 200),
    "previous_length": _count,
    "cut_kind": lambda v: v in ("active_prefix", "terminal_completion"),
    "staging_keys": lambda v: isinstance(v, list) and 0 < len(v) <= MAX_STAGING_KEYS and len(set(v)) == len(v)
    and all(isinstance(k, str) and _KEY.fullmatch(k) for k in v),
    "prefix_token_count": lambda v: _count(v) and v > 0,
    "prefix_digest": lambda v: isinstance(v, str) and _DIGEST.fullmatch(v) is not None,
    "effective_output_limit": lambda v: _count(v) and v > 0,
    "terminal_finish_reason": lambda v: v in (None, "stop", "length"),
}


def _problem(data: dict[str, Any]) -> str | None:
    return next((name for name, valid in _CHECKS.items() if not valid(data[name])), None)


def _valid(data: dict[str, Any]) -> bool:
    return _problem(data) is None


class CutClient:
    """A backend's generation-cut routes under ``control_url``, called with the mesh's control token
    over ``client`` (a pool reserved for control calls)."""

    def __init__(self, client: MeshClient, control_url: str, token: str, server_name: str) -> None:
        self._client = client
        self.url = control_url.rstrip("/") + CUT_PATH
        self._headers = {"authorization": f"Bearer {token}"}
        self.server_name = server_name

    async def cut(
        self, checkpoint_id: str, prefixes: list[GenerationCutPrefix], timeout_s: float
    ) -> list[GenerationCutPrefixAck]:
        """The acks of a receipt checked against the inventory sent (``UpstreamError`` otherwise)."""
        inventory = GenerationCutInventory.build(checkpoint_id, self.server_name, prefixes)
        reply = await self._client.post_json(self.url, inventory.model_dump(mode="json"), headers=self._headers,
                                             idempotent=True, timeout_s=timeout_s, rollout_prefix=False)
        try:
            receipt = GenerationCutReceipt.model_validate(reply)
            receipt.validate_for(inventory)
        except ValidationError as error:
            detail = f"the backend answered an unusable generation-cut receipt: {error.errors()[0]['msg']}"
            raise UpstreamError(detail) from None
        except ValueError as error:
            detail = f"the backend's generation-cut receipt does not answer the inventory: {error}"
            raise UpstreamError(detail) from None
        return receipt.prefixes

    async def keep(self, checkpoint_id: str, keys: Sequence[str], timeout_s: float) -> None:
        """Settle a cut (this project's route; a backend without it answers 404: nothing to settle)."""
        body = {"checkpoint_id": checkpoint_id, "server_name": self.server_name, "staging_keys": list(keys)}
        try:
            await self._client.post_json(self.url + "/keep", body, headers=self._headers, idempotent=True,
                                         timeout_s=timeout_s, rollout_prefix=False)
        except NotFound:
            logger.info("the backend at %s settles no cuts (no /keep route); nothing to settle", self.url)


class GenerationCutter:
    """One cut per commit, and the settling of each checkpoint's staged prefixes."""

    def __init__(self, calls: ActiveCalls, client: CutClient, clock: Clock, telemetry: Telemetry) -> None:
        self.calls = calls
        self.client = client
        self.clock = clock
        self.telemetry = telemetry
        self._unsettled: dict[str, list[str]] = {}  # checkpoint id -> keys it kept (none until committed)
        self.timings: dict[str, float] = {}  # milliseconds of the latest cut's steps (participant status)
        self._settling: asyncio.Task[None] | None = None  # the keep sent after the latest commit

    def _half_left(self, deadline_ts: float) -> float:
        return (deadline_ts - self.clock.now()) / 2

    async def cut(
        self, checkpoint_id: str, scope: Scope | None, deadline_ts: float, lineage_of: LineageOf
    ) -> dict[RolloutIdentity, CutRecord]:
        """The durable cuts of the episodes in scope (none if the cut fails or runs late)."""
        began = time.perf_counter()
        await self.settled(self._half_left(deadline_ts) / 2)
        await self._settle_earlier(checkpoint_id, deadline_ts)
        self.timings = {"settle_earlier_ms": _ms_since(began)}
        tickets = self.calls.cut_candidates(scope)
        timeout_s = self._half_left(deadline_ts)
        if not tickets or timeout_s <= 0:
            return {}
        self._unsettled.setdefault(checkpoint_id, [])
        with self.telemetry.span("generation_cut", **{ATTR.ID: checkpoint_id}) as span:
            try:
                inventory = [GenerationCutPrefix(**ticket.inventory_entry()) for ticket in tickets]
                posted = time.perf_counter()
                acks = await self.client.cut(checkpoint_id, inventory, timeout_s)
                self.timings["cut_request_ms"] = _ms_since(posted)
            except GymError as error:
                logger.warning("generation cut of checkpoint %s failed; its %d calls in flight will be "
                               "generated again after a restore: %s", checkpoint_id, len(tickets), error)
                self.telemetry.event("generation_cut_failed", code=error.code)
                return {}
            cuts = _cut_records(tickets, acks, lineage_of)
            span.set_attribute(ATTR.RECORDS, len(cuts))
        self.timings["cut_ms"] = _ms_since(began)
        return cuts

    def settle(self, checkpoint_id: str, kept: Sequence[str], deadline_ts: float) -> None:
        """The commit is durable: its staged prefixes other than ``kept`` may go (the keep is sent in
        the background; ``settled`` waits for it)."""
        if checkpoint_id not in self._unsettled and not kept:
            return
        self._unsettled[checkpoint_id] = list(kept)
        self._settling = asyncio.ensure_future(self._settle_after(self._settling, checkpoint_id,
                                                                  self._half_left(deadline_ts)))

    async def settled(self, timeout_s: float) -> bool:
        """Wait (up to ``timeout_s``) for the keep sent after the latest commit; ``True`` if none is
        left running. One still running then is cancelled (it is sent again before the next cut)."""
        task = self._settling
        if task is None or task.done():
            return True
        await asyncio.wait({task}, timeout=max(timeout_s, 0))
        if task.done():
            return True
        task.cancel()
        await asyncio.wait({task}, timeout=CANCEL_WAIT_S)
        return False

    async def _settle_after(self, earlier: asyncio.Task[None] | None, checkpoint_id: str, timeout_s: float) -> None:
        began = time.perf_counter()
        if earlier is not None and not earlier.done():
            await asyncio.wait({earlier}, timeout=timeout_s)
        await self._settle(checkpoint_id, timeout_s - (time.perf_counter() - began))
        self.timings["keep_after_reply_ms"] = _ms_since(began)

    async def _settle_earlier(self, checkpoint_id: str, deadline_ts: float) -> None:
        for earlier in [cid for cid in self._unsettled if cid != checkpoint_id]:
            await self._settle(earlier, self._half_left(deadline_ts) / 2)

    async def _settle(self, checkpoint_id: str, timeout_s: float) -> None:
        if timeout_s <= 0 or checkpoint_id not in self._unsettled:
            return
        try:
            await self.client.keep(checkpoint_id, self._unsettled[checkpoint_id], timeout_s)
        except GymError as error:
            logger.warning("settling the generation cut of checkpoint %s failed (retried before the next "
                           "cut): %s", checkpoint_id, error)
            return
        del self._unsettled[checkpoint_id]


def _ms_since(began: float) -> float:
    return round(1000 * (time.perf_counter() - began), 3)


def _cut_records(
    tickets: Sequence[Ticket], acks: Sequence[GenerationCutPrefixAck], lineage_of: LineageOf
) -> dict[RolloutIdentity, CutRecord]:
    by_ticket = {ack.ticket_id: ack for ack in acks}
    cuts = {}
    for ticket in tickets:
        ack = by_ticket.get(ticket.ticket_id)
        record = CutRecord.of(ticket, ack) if ack is not None else None
        if record is None:
            continue
        if lineage_of(ticket.episode) != record.lineage:
            logger.info("cut of %s dropped: the rollout delivered another call since it was admitted",
                        ticket.model_call_id)
            continue
        cuts[ticket.episode] = record
    return cuts
