"""A completion that continues a staged prefix: checked before it starts, then assembled as one.

``check_continuation`` compares the staged prefix (already loaded and matched to its key's digest
by the staging store) with the continuation the policy model asked for and with the request
itself. Any mismatch is 422 ``invalid_checkpoint_state``, never silently wrong training data:

| check | what must hold |
|---|---|
| source call | the staged call id is the continuation's ``source_call_id`` |
| prefix digest | ``token_digest(staged ids)`` = staged ``prefix_digest`` = the continuation's |
| token count | ids, logprobs, staged ``prefix_token_count`` and the continuation's count all agree |
| rollout | the request's rollout is the staged one, at a later attempt |
| lineage | the request's ``model_call`` parent call and previous length are the staged ones |
| policy version | the staged prefix's version is not newer than the engine's |
| prompt | the request's prompt ids have the staged prompt digest and length |
| sampling | max_tokens, seed, temperature, top_p, stops, ignore_eos, skip_special_tokens unchanged |
| output limit | the continuation's ``effective_output_limit`` is the staged one |

``continued_job`` then builds the job: the reply's builder is fed the staged tokens and logprobs
first (so text, stop strings, token ids and logprobs run over prefix + continuation as one
completion, stamped with the prefix's policy version) and the engine gets
``GenerationRequest.continuation(prefix)``: prompt + prefix ids exactly, ``max_tokens`` reduced,
the same seed. A terminal completion is answered from staging without generating anything.
"""

from __future__ import annotations

import math

from model_servers.inference_worker.completions import CompletionBuilder, CompletionPlan
from model_servers.inference_worker.cut_models import ContinuationRef, ModelCall
from model_servers.inference_worker.engine import EngineTokenizer, FinishReason, TokenStep
from model_servers.inference_worker.live_generations import GenerationJob, staged_sampling
from model_servers.inference_worker.staging import StagedPrefix, token_digest
from nemo_gym_ckpt.errors import InvalidCheckpointState
from nemo_gym_ckpt.identity import RolloutIdentity

__all__ = ["check_continuation", "continued_job"]


def _require(holds: bool, key: str, what: str) -> None:
    if not holds:
        raise InvalidCheckpointState(f"continuation of staged prefix {key}: {what}")


def check_continuation(
    staged: StagedPrefix, ref: ContinuationRef, call: ModelCall, identity: RolloutIdentity | None,
    plan: CompletionPlan, engine_version: int,
) -> None:
    """Every check of the table above, in order; the first failure raises."""
    key = ref.staging_keys[0]
    _require(staged.source_call_id == ref.source_call_id,
             key, f"source call {staged.source_call_id}, expected {ref.source_call_id}")
    actual = token_digest(staged.token_ids)
    _require(actual == staged.prefix_digest == ref.prefix_digest, key,
             f"prefix digest {ref.prefix_digest[:12]}.. asked, staged {staged.prefix_digest[:12]}.., "
             f"tokens hash to {actual[:12]}..")
    counts = {ref.prefix_token_count, staged.prefix_token_count, len(staged.token_ids), len(staged.logprobs)}
    _require(len(counts) == 1, key, f"token counts disagree: asked {ref.prefix_token_count}, staged "
             f"{staged.prefix_token_count}, {len(staged.token_ids)} ids, {len(staged.logprobs)} logprobs")
    _check_rollout_and_lineage(staged, call, identity, key)
    _require(staged.policy_version <= engine_version, key,
             f"the prefix's policy version {staged.policy_version} is newer than the engine's "
             f"{engine_version}")
    prompt = plan.generation.prompt_token_ids
    _require(len(prompt) == staged.prompt_length and token_digest(prompt) == staged.prompt_digest, key,
             f"the prompt ({len(prompt)} ids) is not the staged prompt ({staged.prompt_length} ids)")
    _require(staged_sampling(plan) == staged.sampling, key, "sampling settings differ from the staged ones")
    _require(ref.effective_output_limit == staged.effective_output_limit, key,
             f"effective_output_limit {ref.effective_output_limit}, staged {staged.effective_output_limit}")


def _check_rollout_and_lineage(
    staged: StagedPrefix, call: ModelCall, identity: RolloutIdentity | None, key: str
) -> None:
    _require(identity is not None and identity.rollout_id == staged.rollout_id
             and identity.attempt > staged.attempt, key,
             f"asked by {identity.capture_key if identity else 'no rollout'}, staged for "
             f"{staged.rollout_id} attempt {staged.attempt} (a later attempt of it must continue)")
    lineage = (call.parent_call_id, call.previous_length)
    _require(lineage == (staged.parent_call_id, staged.previous_length), key,
             f"lineage (parent {lineage[0]}, previous length {lineage[1]}), staged (parent "
             f"{staged.parent_call_id}, previous length {staged.previous_length})")


def continued_job(
    staged: StagedPrefix, plan: CompletionPlan, tokenizer: EngineTokenizer, served_model: str
) -> GenerationJob:
    """The job of a checked continuation: builder pre-fed with the prefix; engine request after it."""
    key = f"{staged.source_call_id} (checkpoint {staged.checkpoint_id})"
    builder = CompletionBuilder(plan, tokenizer, served_model, staged.policy_version)
    terminal = staged.cut_kind == "terminal_completion"
    last = len(staged.token_ids) - 1
    for index, (token_id, logprob) in enumerate(zip(staged.token_ids, staged.logprobs, strict=True)):
        finish: FinishReason | None = staged.last_step_finish if terminal and index == last else None
        finished = builder.add(TokenStep(token_id, math.nan if logprob is None else logprob, finish))
        _require(not finished or index == last, key, f"the staged tokens finish early, at token {index}")
    if terminal:
        _require(builder.finish_reason == staged.finish_reason, key,
                 f"the staged completion finishes as {builder.finish_reason}, staged {staged.finish_reason}")
        return GenerationJob(plan.generation, builder)
    _require(builder.finish_reason is None and staged.prefix_token_count < plan.generation.max_tokens, key,
             "an active prefix that is already a finished completion")
    return GenerationJob(plan.generation.continuation(staged.token_ids), builder)
