"""The generations a worker is running, by model call id: what a generation cut freezes.

With checkpointing on, every completion runs as a ``GenerationJob`` whose ``LiveGeneration`` is
registered in ``LiveGenerations`` from its first token to its end (listed by the cut status and
counted); one that names its ``model_call`` can be found, and cut, by that call id. The tokens
a generation has taken live in its ``CompletionBuilder``; ``freeze`` copies them at a token
boundary, in synchronous code (no token can be added while it runs), and the generation goes on
untouched: a cut never pauses, aborts or re-prefills it, so without a crash its output is exactly
the uncut one. A generation that finished stays findable for a while (the ``RECENT`` last ones),
so a cut that arrives while its reply travels to the policy model is a terminal completion; one
that was cancelled or failed is forgotten at once.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, cast

from model_servers.inference_worker.completions import CompletionBuilder, CompletionPlan
from model_servers.inference_worker.cut_models import ActivePrefix, CutRequest, ModelCall
from model_servers.inference_worker.engine import GenerationRequest, TokenStep
from model_servers.inference_worker.staging import Finish, StagedPrefix, StagedSampling, token_digest
from nemo_gym_ckpt.identity import RolloutIdentity

__all__ = ["RECENT", "Frozen", "GenerationJob", "LiveGeneration", "LiveGenerations", "staged_sampling"]

RECENT = 1024


def staged_sampling(plan: CompletionPlan) -> StagedSampling:
    """The settings a continuation of ``plan``'s generation must repeat."""
    generation = plan.generation
    return StagedSampling(
        max_tokens=generation.max_tokens, seed=generation.seed, temperature=generation.temperature,
        top_p=generation.top_p, stop=plan.stop_strings, stop_token_ids=generation.stop_token_ids,
        ignore_eos=generation.ignore_eos, skip_special_tokens=plan.skip_special_tokens,
    )


@dataclass(frozen=True)
class Frozen:
    """A generation's tokens at one token boundary (an immutable copy)."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: Finish | None
    last_step_finish: Finish | None

    @property
    def terminal(self) -> bool:
        return self.finish_reason is not None


@dataclass(eq=False)
class LiveGeneration:
    """One generation a cut may freeze: its call, rollout, tokens and what it was asked for."""

    call: ModelCall | None  # None: a completion that did not name its call (never cut)
    identity: RolloutIdentity | None
    builder: CompletionBuilder
    prompt_digest: str
    policy_version: int  # a continuation keeps its prefix's (older) version

    @property
    def finished(self) -> bool:
        return self.builder.finish_reason is not None

    def belongs_to(self, entry: ActivePrefix) -> bool:
        return self.identity == RolloutIdentity(entry.rollout_id, entry.attempt)

    def freeze(self) -> Frozen:
        builder = self.builder
        finish, last = builder.finish_reason, builder.last_step_finish
        return Frozen(tuple(builder.token_ids), tuple(builder.token_logprobs), cast(Finish | None, finish),
                      cast(Finish | None, last))

    def staged(
        self, request: CutRequest, entry: ActivePrefix, frozen: Frozen, created_at: float
    ) -> StagedPrefix:
        """The staging file content of this generation cut at ``frozen``."""
        assert self.call is not None  # only generations found by their call id are cut
        plan = self.builder.plan
        return StagedPrefix(
            checkpoint_id=request.checkpoint_id, server_name=request.server_name, ticket_id=entry.ticket_id,
            source_call_id=self.call.model_call_id, rollout_id=entry.rollout_id, attempt=entry.attempt,
            parent_call_id=self.call.parent_call_id, previous_length=self.call.previous_length,
            cut_kind="terminal_completion" if frozen.terminal else "active_prefix",
            finish_reason=frozen.finish_reason, last_step_finish=frozen.last_step_finish,
            prompt_digest=self.prompt_digest, prompt_length=len(plan.generation.prompt_token_ids),
            sampling=staged_sampling(plan), policy_version=self.policy_version,
            prefix_token_count=len(frozen.token_ids), prefix_digest=token_digest(frozen.token_ids),
            token_ids=frozen.token_ids,
            logprobs=tuple(value if math.isfinite(value) else None for value in frozen.logprobs),
            created_at=created_at,
        )


class LiveGenerations:
    """Running generations by model call id, the recently finished ones, and token counters."""

    def __init__(self, recent: int = RECENT) -> None:
        self._live: dict[str, LiveGeneration] = {}
        self._anonymous: set[LiveGeneration] = set()
        self._ended: OrderedDict[str, LiveGeneration] = OrderedDict()
        self._recent = recent
        self.tokens_generated = 0
        self.tokens_from_staging = 0

    def __len__(self) -> int:
        return len(self._live) + len(self._anonymous)

    def find(self, model_call_id: str) -> LiveGeneration | None:
        return self._live.get(model_call_id) or self._ended.get(model_call_id)

    @contextmanager
    def running(self, generation: LiveGeneration) -> Iterator[None]:
        """Registered while the block runs; kept among the recent ones if it finished."""
        if generation.call is None:
            self._anonymous.add(generation)
            try:
                yield
            finally:
                self._anonymous.discard(generation)
            return
        call_id = generation.call.model_call_id
        self._ended.pop(call_id, None)
        self._live[call_id] = generation
        try:
            yield
        finally:
            if self._live.get(call_id) is generation:
                del self._live[call_id]
            if generation.finished:
                self._ended[call_id] = generation
                while len(self._ended) > self._recent:
                    self._ended.popitem(last=False)

    def summary(self) -> list[dict[str, Any]]:
        return [{"model_call_id": g.call.model_call_id if g.call else None,
                 "capture_key": g.identity.capture_key if g.identity else None,
                 "tokens": len(g.builder.token_ids), "finished": g.finished}
                for g in (*self._live.values(), *self._anonymous)]


@dataclass(eq=False)
class GenerationJob:
    """What one completion runs: the engine request (a continuation: prompt + prefix), the builder
    that assembles the reply (pre-fed with a continued prefix), and its registration for cuts."""

    request: GenerationRequest
    builder: CompletionBuilder
    live: LiveGeneration | None = None
    registry: LiveGenerations | None = None

    @contextmanager
    def tracked(self) -> Iterator[None]:
        if self.live is None or self.registry is None:
            yield
            return
        with self.registry.running(self.live):
            yield

    def add(self, step: TokenStep) -> bool:
        """Take one engine token; True once the completion is finished."""
        if self.registry is not None:
            self.registry.tokens_generated += 1
        return self.builder.add(step)
