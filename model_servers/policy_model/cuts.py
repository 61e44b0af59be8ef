"""Generation cuts on the policy model's side (docs/protocol.md section 8, second half).

At commit, before the export, ``GenerationCutter.cut`` takes per episode in scope the latest
admitted call still generating (``ActiveCalls.cut_candidates``) and posts their inventory to the
worker's ``/ng-control/v1/generation-cut`` with **half of the remaining commit deadline**. Each
``durable_prefix`` receipt becomes a ``CutRecord`` in that episode's ledger record: coordinates and
digests only (staging keys, counts, digests, lineage), never token arrays. A cut that fails, is
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
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from model_servers.policy_model.active_calls import ActiveCalls, Ticket
from model_servers.policy_model.generation import CutContinuation
from model_servers.policy_model.ids import sha256_of
from nemo_gym_ckpt.checkpoint.clock import Clock
from nemo_gym_ckpt.checkpoint.records import Scope
from nemo_gym_ckpt.checkpoint.telemetry import ATTR, Telemetry
from nemo_gym_ckpt.client import MeshClient
from nemo_gym_ckpt.errors import GymError, InvalidCheckpointState, UpstreamError
from nemo_gym_ckpt.identity import RolloutIdentity

__all__ = ["CUT_FIELDS", "CUT_PATH", "CutClient", "CutRecord", "GenerationCutter", "Lineage", "LineageOf",
           "Receipt"]

logger = logging.getLogger(__name__)

CUT_PATH = "/ng-control/v1/generation-cut"
CANCEL_WAIT_S = 5.0
_DIGEST = re.compile(r"[0-9a-f]{64}")
_CALL_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")
_KEY = re.compile(r"[A-Za-z0-9_-]{1,128}\.[0-9a-f]{64}")
Lineage = tuple[str | None, int]  # (parent call id, previous length) of a rollout's ledger
LineageOf = Callable[[RolloutIdentity], Lineage]


class Receipt(BaseModel):
    """One ticket's acknowledgement from the worker (fields the model server uses)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    ticket_id: str
    disposition: Literal["durable_prefix", "durable_failure"]
    cut_kind: Literal["active_prefix", "terminal_completion"] | None = None
    staging_keys: list[str] = []
    prefix_token_count: int = 0
    prefix_digest: str | None = None
    effective_output_limit: int | None = None
    terminal_finish_reason: Literal["stop", "length"] | None = None
    detail: str | None = None


class _CutReply(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    receipts: list[Receipt]


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
    def of(cls, ticket: Ticket, receipt: Receipt) -> CutRecord | None:
        """The record of a durable receipt (``None`` for a failure or an unusable receipt)."""
        durable = receipt.disposition == "durable_prefix"
        if not durable or receipt.cut_kind is None or receipt.prefix_digest is None:
            return None
        record = cls(ticket.model_call_id, ticket.conversation_digest, ticket.parent_call_id,
                     ticket.previous_length, receipt.cut_kind, tuple(receipt.staging_keys),
                     receipt.prefix_token_count, receipt.prefix_digest, receipt.effective_output_limit or 0,
                     receipt.terminal_finish_reason)
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
    return type(value) is int and value >= 0


_CHECKS: dict[str, Callable[[Any], bool]] = {
    "source_call_id": lambda v: isinstance(v, str) and _CALL_ID.fullmatch(v) is not None,
    "conversation_digest": lambda v: isinstance(v, str) and _DIGEST.fullmatch(v) is not None,
    "parent_call_id": lambda v: v is None or (isinstance(v, str) and 0 < len(v) <= 200),
    "previous_length": _count,
    "cut_kind": lambda v: v in ("active_prefix", "terminal_completion"),
    "staging_keys": lambda v: isinstance(v, list) and len(v) == 1
    and all(isinstance(k, str) and _KEY.fullmatch(k) for k in v),
    "prefix_token_count": lambda v: _count(v) and v > 0,
    "prefix_digest": lambda v: isinstance(v, str) and _DIGEST.fullmatch(v) is not None,
    "effective_output_limit": _count,
    "terminal_finish_reason": lambda v: v in (None, "stop", "length"),
}


def _problem(data: dict[str, Any]) -> str | None:
    return next((name for name, valid in _CHECKS.items() if not valid(data[name])), None)


def _valid(data: dict[str, Any]) -> bool:
    return _problem(data) is None


class CutClient:
    """The worker's generation-cut routes, called with the mesh's control token."""

    def __init__(self, client: MeshClient, worker_url: str, token: str, server_name: str) -> None:
        self._client = client
        self._url = worker_url.rstrip("/") + CUT_PATH
        self._headers = {"authorization": f"Bearer {token}"}
        self.server_name = server_name

    async def cut(
        self, checkpoint_id: str, inventory: list[dict[str, Any]], timeout_s: float
    ) -> list[Receipt]:
        body = {"checkpoint_id": checkpoint_id, "server_name": self.server_name,
                "active_prefixes": inventory, "inventory_digest": sha256_of(inventory)}
        reply = await self._client.post_json(self._url, body, headers=self._headers, idempotent=True,
                                             timeout_s=timeout_s, rollout_prefix=False)
        try:
            return _CutReply.model_validate(reply).receipts
        except ValidationError as error:
            detail = f"the worker answered an unusable generation-cut reply: {error.errors()[0]}"
            raise UpstreamError(detail) from None

    async def keep(self, checkpoint_id: str, keys: Sequence[str], timeout_s: float) -> None:
        body = {"checkpoint_id": checkpoint_id, "server_name": self.server_name, "staging_keys": list(keys)}
        await self._client.post_json(self._url + "/keep", body, headers=self._headers, idempotent=True,
                                     timeout_s=timeout_s, rollout_prefix=False)


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
                inventory = [ticket.inventory_entry() for ticket in tickets]
                posted = time.perf_counter()
                receipts = await self.client.cut(checkpoint_id, inventory, timeout_s)
                self.timings["cut_request_ms"] = _ms_since(posted)
            except GymError as error:
                logger.warning("generation cut of checkpoint %s failed; its %d calls in flight will be "
                               "generated again after a restore: %s", checkpoint_id, len(tickets), error)
                self.telemetry.event("generation_cut_failed", code=error.code)
                return {}
            cuts = _cut_records(tickets, receipts, lineage_of)
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
    tickets: Sequence[Ticket], receipts: Sequence[Receipt], lineage_of: LineageOf
) -> dict[RolloutIdentity, CutRecord]:
    by_ticket = {receipt.ticket_id: receipt for receipt in receipts}
    cuts = {}
    for ticket in tickets:
        receipt = by_ticket.get(ticket.ticket_id)
        record = CutRecord.of(ticket, receipt) if receipt is not None else None
        if record is None:
            continue
        if lineage_of(ticket.episode) != record.lineage:
            logger.info("cut of %s dropped: the rollout delivered another call since it was admitted",
                        ticket.model_call_id)
            continue
        cuts[ticket.episode] = record
    return cuts
