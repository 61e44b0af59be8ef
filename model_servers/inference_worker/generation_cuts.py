"""The worker's side of generation cuts: freeze, stage, receipt; keep; continue (docs/protocol.md section 8).

``cut(request)`` answers ``POST /ng-control/v1/generation-cut`` with upstream's wire
(``nemo_gym_ckpt.checkpoint.cut_wire``). It checks the inventory digest (upstream's formula), then
freezes every listed generation in one synchronous pass (all at the same instant, each at a token
boundary; none is paused or stopped), writes the frozen prefixes as one staging file (one fsync,
one rename, one directory fsync: ``StagingStore.stage``, in one worker thread), and only then
answers the receipt ``{checkpoint_id, cut_id, inventory_digest, inventory, backend_snapshot_id,
prefixes}``: one ack per ticket, in inventory order, ``durable_prefix`` with its evidence
(``frozen_buffer_id`` and the one staging key are the same key; ``effective_output_limit`` is the
call's whole output budget, its ``max_tokens``) or ``durable_failure`` with none. Why a ticket
failed (no such generation here, another rollout's, constrained decoding, nothing generated yet,
staging full or failing) is logged with the call's id and counted by reason in the status
(``cut_failures``; each reason is a fixed string that never names a call, so its keys stay few),
since upstream's ack has no field for it; that call is simply generated again after a restore. One cut runs at a
time; the same request again gets the same receipt. ``keep(request)`` settles a checkpoint's cut (its other staged
prefixes are dropped); a cut of a settled checkpoint stages nothing, and the prefixes of a cut that
was still being written when its checkpoint was settled are dropped as soon as it ends. The status
route reports the milliseconds of the latest cut's steps (``last_cut_ms``: waiting for the cut
lock, freezing, staging, in all) and of the latest keep (``last_keep_ms``).

``continuation_job`` loads and checks a staged prefix for a completion that continues it
(``continuation``); a prefix that is simply not there (evicted, or staged on another host) is not a
mismatch: the completion is generated afresh and counted (``continuations_missing``), and the
rollout goes on. ``fresh_job`` registers a new generation that names its ``model_call``.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from model_servers.inference_worker.completions import (
    CompletionBuilder,
    CompletionPlan,
    CompletionRequest,
    plan_completion,
)
from model_servers.inference_worker.continuation import check_continuation, continued_job
from model_servers.inference_worker.cut_models import ActivePrefix, CutRequest, KeepRequest
from model_servers.inference_worker.engine import Engine
from model_servers.inference_worker.live_generations import GenerationJob, LiveGeneration, LiveGenerations
from model_servers.inference_worker.staging import StagedPrefix, StagedPrefixMissing, StagingStore, token_digest
from nemo_gym_ckpt.checkpoint.cut_wire import GenerationCutPrefixAck
from nemo_gym_ckpt.errors import InvalidCheckpointState, InvalidRequest
from nemo_gym_ckpt.identity import RolloutIdentity

__all__ = ["REMEMBERED", "GenerationCuts"]

REMEMBERED = 64
Owner = tuple[str, str]
K = TypeVar("K")
V = TypeVar("V")
logger = logging.getLogger(__name__)
STAGING_REFUSED = "staging refused the prefix (bounds reached, or an I/O error)"
#: Fixed, like every reason: ``cut_failures`` counts by reason, so a reason never names a call (the
#: call id goes to the log).
ANOTHER_ATTEMPT = "the call belongs to another rollout attempt"


def _failure(entry: ActivePrefix) -> dict[str, Any]:
    return GenerationCutPrefixAck.failure(entry).model_dump(mode="json")


def _durable(entry: ActivePrefix, prefix: StagedPrefix, key: str) -> dict[str, Any]:
    ack = GenerationCutPrefixAck(
        **entry.model_dump(), disposition="durable_prefix", cut_kind=prefix.cut_kind, frozen_buffer_id=key,
        staging_keys=[key], prefix_token_count=prefix.prefix_token_count, prefix_digest=prefix.prefix_digest,
        effective_output_limit=prefix.effective_output_limit,
        terminal_finish_reason=prefix.finish_reason if prefix.cut_kind == "terminal_completion" else None,
    )
    return ack.model_dump(mode="json")


def _ms_since(began: float) -> float:
    return round(1000 * (time.perf_counter() - began), 3)


def _remember(memory: OrderedDict[K, V], key: K, value: V) -> None:
    memory[key] = value
    memory.move_to_end(key)
    while len(memory) > REMEMBERED:
        memory.popitem(last=False)


class GenerationCuts:
    """Live generations, the staging store, and the cut, keep and continuation operations."""

    def __init__(self, store: StagingStore, registry: LiveGenerations | None = None,
                 *, clock: Callable[[], float] = time.time) -> None:
        self.store = store
        self.registry = registry or LiveGenerations()
        self.clock = clock
        self.cuts = 0
        self.cut_failures: Counter[str] = Counter()  # why tickets got durable_failure (status)
        self.continuations_missing = 0  # continued calls generated afresh: their prefix was not here
        self.last_cut: dict[str, float] = {}  # milliseconds per phase of the latest cut (status)
        self.last_keep_ms: float | None = None
        self._lock = asyncio.Lock()
        self._replies: OrderedDict[tuple[str, str, str], dict[str, Any]] = OrderedDict()
        self._settled: OrderedDict[Owner, frozenset[str]] = OrderedDict()

    async def open(self) -> None:
        await asyncio.to_thread(self.store.open)

    # ---- completions -------------------------------------------------------------------------

    def fresh_job(
        self, body: CompletionRequest, plan: CompletionPlan, engine: Engine, served_model: str,
        identity: RolloutIdentity | None,
    ) -> GenerationJob:
        builder = CompletionBuilder(plan, engine.tokenizer, served_model, engine.policy_version)
        job = GenerationJob(plan.generation, builder)
        return self._track(job, body, identity, engine.policy_version)

    async def continuation_job(
        self, body: CompletionRequest, engine: Engine, served_model: str, identity: RolloutIdentity | None,
    ) -> GenerationJob:
        ref, call = body.continuation, body.model_call
        assert ref is not None
        if call is None:
            raise InvalidRequest("a continuation needs model_call (the continuing call and its lineage)")
        try:
            staged = await asyncio.to_thread(self.store.load, ref.staging_keys[0])
        except StagedPrefixMissing as missing:
            self.continuations_missing += 1
            logger.warning("continuation of %s generated afresh: %s", call.model_call_id, missing.detail)
            fresh = body.model_copy(update={"continuation": None})
            # the policy model always sends the call's seed; without one the fresh call is seeded 0
            plan = await asyncio.to_thread(plan_completion, fresh, engine, served_model=served_model,
                                           next_seed=lambda: 0)
            return self.fresh_job(fresh, plan, engine, served_model, identity)
        seed = staged.sampling.seed

        def continue_staged() -> GenerationJob:  # O(prompt + prefix): off the event loop
            plan = plan_completion(body, engine, served_model=served_model, next_seed=lambda: seed)
            check_continuation(staged, ref, call, identity, plan, engine.policy_version)
            return continued_job(staged, plan, engine.tokenizer, served_model)

        job = await asyncio.to_thread(continue_staged)
        self.registry.tokens_from_staging += staged.prefix_token_count
        return self._track(job, body, identity, staged.policy_version)

    def _track(
        self, job: GenerationJob, body: CompletionRequest, identity: RolloutIdentity | None, version: int
    ) -> GenerationJob:
        prompt = token_digest(job.builder.plan.generation.prompt_token_ids) if body.model_call else ""
        job.live = LiveGeneration(body.model_call, identity, job.builder, prompt, version)
        job.registry = self.registry
        return job

    # ---- cut -----------------------------------------------------------------------------------

    async def cut(self, request: CutRequest) -> dict[str, Any]:
        digest = request.expected_digest()
        if digest != request.inventory_digest:
            raise InvalidCheckpointState(f"inventory_digest {request.inventory_digest[:12]}.. does not match "
                                         f"the active_prefixes sent (they hash to {digest[:12]}..)")
        memo = (request.server_name, request.checkpoint_id, digest)
        began = time.perf_counter()
        async with self._lock:
            if memo not in self._replies:
                self.last_cut = {"lock_ms": _ms_since(began)}
                _remember(self._replies, memo, await self._cut(request))
                self.last_cut["total_ms"] = _ms_since(began)
        return self._replies[memo]

    async def _cut(self, request: CutRequest) -> dict[str, Any]:
        owner = (request.server_name, request.checkpoint_id)
        now, began = self.clock(), time.perf_counter()
        if owner in self._settled:
            decisions: list[StagedPrefix | str] = ["the checkpoint was already settled"] * len(
                request.active_prefixes)
        else:
            decisions = [self._freeze(request, entry, now) for entry in request.active_prefixes]
        prefixes = [decision for decision in decisions if isinstance(decision, StagedPrefix)]
        self.last_cut["freeze_ms"], staging = _ms_since(began), time.perf_counter()
        staged = iter(await asyncio.to_thread(self.store.stage, prefixes) if prefixes else [])
        self.last_cut["stage_ms"] = _ms_since(staging)
        acks = [self._ack(entry, decision, staged)
                for entry, decision in zip(request.active_prefixes, decisions, strict=True)]
        await self._discard_if_settled(owner, acks)
        self.cuts += 1
        return {"checkpoint_id": request.checkpoint_id, "cut_id": f"cut-{secrets.token_hex(8)}",
                "inventory_digest": request.inventory_digest, "inventory": request.model_dump(mode="json"),
                "backend_snapshot_id": f"snapshot-{secrets.token_hex(8)}", "prefixes": acks}

    def _freeze(self, request: CutRequest, entry: ActivePrefix, now: float) -> StagedPrefix | str:
        """The prefix of one ticket's generation at this instant, or why there is none."""
        generation = self.registry.find(entry.model_call_id)
        if generation is None:
            return "no generation of this call here (not started, cancelled, or long finished)"
        if not generation.belongs_to(entry):
            logger.debug("generation cut of %s (ticket %s): its generation is of %r, not of rollout %s "
                         "attempt %d", entry.model_call_id, entry.ticket_id, generation.identity,
                         entry.rollout_id, entry.attempt)
            return ANOTHER_ATTEMPT
        if generation.call is None or generation.call.constrained:
            return "constrained decoding is never cut"
        frozen = generation.freeze()
        if not frozen.token_ids:
            return "nothing generated yet"
        return generation.staged(request, entry, frozen, now)

    def _ack(self, entry: ActivePrefix, decision: StagedPrefix | str, staged: Iterator[str | None]) -> dict[str, Any]:
        key = None if isinstance(decision, str) else next(staged)
        if isinstance(decision, StagedPrefix) and key is not None:
            return _durable(entry, decision, key)
        reason = decision if isinstance(decision, str) else STAGING_REFUSED
        self.cut_failures[reason] += 1
        logger.info("generation cut of %s (ticket %s): durable_failure: %s", entry.model_call_id,
                    entry.ticket_id, reason)
        return _failure(entry)

    async def _discard_if_settled(self, owner: Owner, acks: list[dict[str, Any]]) -> None:
        """A checkpoint settled while its cut was being written keeps only what it listed."""
        kept = self._settled.get(owner)
        if kept is None:
            return
        late = [key for ack in acks for key in ack["staging_keys"] if key not in kept]
        if late:
            await asyncio.to_thread(self.store.discard, late)

    # ---- keep ----------------------------------------------------------------------------------

    async def keep(self, request: KeepRequest) -> dict[str, Any]:
        owner = (request.server_name, request.checkpoint_id)
        _remember(self._settled, owner, frozenset(request.staging_keys))
        began = time.perf_counter()
        result = await asyncio.to_thread(self.store.keep, owner, request.staging_keys)
        self.last_keep_ms = _ms_since(began)
        return {"kept": result.kept, "deleted": len(result.deleted), "missing": result.missing}

    def status(self) -> dict[str, Any]:
        return {"live_generations": self.registry.summary(), "staging": self.store.stats(), "cuts": self.cuts,
                "cut_failures": dict(self.cut_failures), "continuations_missing": self.continuations_missing,
                "last_cut_ms": self.last_cut, "last_keep_ms": self.last_keep_ms,
                "tokens_generated": self.registry.tokens_generated,
                "tokens_from_staging": self.registry.tokens_from_staging}
