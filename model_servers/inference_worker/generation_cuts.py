"""The worker's side of generation cuts: freeze, stage, receipt; keep; continue (docs/protocol.md section 8).

``cut(request)`` answers ``POST /ng-control/v1/generation-cut``. It checks the inventory digest,
then freezes every listed generation in one synchronous pass (all at the same instant, each at a
token boundary; none is paused or stopped), writes the frozen prefixes as one staging file (one
fsync, one rename, one directory fsync: ``StagingStore.stage``, in one worker thread), and only
then answers one receipt per ticket:

    {ticket_id, model_call_id, disposition: durable_prefix | durable_failure,
     cut_kind: active_prefix | terminal_completion | null, staging_keys, prefix_token_count,
     prefix_digest, effective_output_limit, terminal_finish_reason, detail}

``durable_failure`` means no prefix was staged for the ticket (``detail`` says why: no such
generation here, another rollout's, constrained decoding, nothing generated yet, staging full or
failing); that call is simply generated again after a restore. One cut runs at a time; the same
request again gets the same reply. ``keep(request)`` settles a checkpoint's cut (its other staged
prefixes are dropped); a cut of a settled checkpoint stages nothing, and the prefixes of a cut that
was still being written when its checkpoint was settled are dropped as soon as it ends. The status
route reports the milliseconds of the latest cut's steps (``last_cut_ms``: waiting for the cut
lock, freezing, staging, in all) and of the latest keep (``last_keep_ms``).

``continuation_job`` loads and checks a staged prefix for a completion that continues it
(``continuation``); ``fresh_job`` registers a new generation that names its ``model_call``.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from model_servers.inference_worker.completions import (
    CompletionBuilder,
    CompletionPlan,
    CompletionRequest,
    plan_completion,
)
from model_servers.inference_worker.continuation import check_continuation, continued_job
from model_servers.inference_worker.cut_models import ActivePrefix, CutRequest, KeepRequest, inventory_digest
from model_servers.inference_worker.engine import Engine
from model_servers.inference_worker.live_generations import GenerationJob, LiveGeneration, LiveGenerations
from model_servers.inference_worker.staging import StagedPrefix, StagingStore, token_digest
from nemo_gym_ckpt.errors import InvalidCheckpointState, InvalidRequest
from nemo_gym_ckpt.identity import RolloutIdentity

__all__ = ["REMEMBERED", "GenerationCuts"]

REMEMBERED = 64
Owner = tuple[str, str]
K = TypeVar("K")
V = TypeVar("V")


def _failure(entry: ActivePrefix, detail: str) -> dict[str, Any]:
    return {"ticket_id": entry.ticket_id, "model_call_id": entry.model_call_id,
            "disposition": "durable_failure", "cut_kind": None, "staging_keys": [], "prefix_token_count": 0,
            "prefix_digest": None, "effective_output_limit": None, "terminal_finish_reason": None,
            "detail": detail}


def _durable(entry: ActivePrefix, prefix: StagedPrefix, key: str) -> dict[str, Any]:
    return {"ticket_id": entry.ticket_id, "model_call_id": entry.model_call_id,
            "disposition": "durable_prefix", "cut_kind": prefix.cut_kind, "staging_keys": [key],
            "prefix_token_count": prefix.prefix_token_count, "prefix_digest": prefix.prefix_digest,
            "effective_output_limit": prefix.effective_output_limit,
            "terminal_finish_reason": prefix.finish_reason, "detail": None}


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
        staged = await asyncio.to_thread(self.store.load, ref.staging_keys[0])
        seed = staged.sampling.seed
        plan = plan_completion(body, engine, served_model=served_model, next_seed=lambda: seed)
        check_continuation(staged, ref, call, identity, plan, engine.policy_version)
        job = continued_job(staged, plan, engine.tokenizer, served_model)
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
        digest = inventory_digest([entry.model_dump() for entry in request.active_prefixes])
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
        receipts = [self._receipt(entry, decision, staged)
                    for entry, decision in zip(request.active_prefixes, decisions, strict=True)]
        await self._discard_if_settled(owner, receipts)
        self.cuts += 1
        return {"cut_id": f"cut-{secrets.token_hex(8)}", "checkpoint_id": request.checkpoint_id,
                "server_name": request.server_name, "inventory_digest": request.inventory_digest,
                "receipts": receipts}

    def _freeze(self, request: CutRequest, entry: ActivePrefix, now: float) -> StagedPrefix | str:
        """The prefix of one ticket's generation at this instant, or why there is none."""
        generation = self.registry.find(entry.model_call_id)
        if generation is None:
            return "no generation of this call here (not started, cancelled, or long finished)"
        if not generation.belongs_to(entry):
            return f"call {entry.model_call_id} belongs to another rollout attempt"
        if generation.call is None or generation.call.constrained:
            return "constrained decoding is never cut"
        frozen = generation.freeze()
        if not frozen.token_ids:
            return "nothing generated yet"
        return generation.staged(request, entry, frozen, now)

    @staticmethod
    def _receipt(
        entry: ActivePrefix, decision: StagedPrefix | str, staged: Iterator[str | None]
    ) -> dict[str, Any]:
        if isinstance(decision, str):
            return _failure(entry, decision)
        key = next(staged)
        if key is None:
            return _failure(entry, "staging refused the prefix (bounds reached, or an I/O error)")
        return _durable(entry, decision, key)

    async def _discard_if_settled(self, owner: Owner, receipts: list[dict[str, Any]]) -> None:
        """A checkpoint settled while its cut was being written keeps only what it listed."""
        kept = self._settled.get(owner)
        if kept is None:
            return
        late = [key for receipt in receipts for key in receipt["staging_keys"] if key not in kept]
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
                "last_cut_ms": self.last_cut, "last_keep_ms": self.last_keep_ms,
                "tokens_generated": self.registry.tokens_generated,
                "tokens_from_staging": self.registry.tokens_from_staging}
