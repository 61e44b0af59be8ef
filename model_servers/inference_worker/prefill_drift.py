"""How far a continued generation drifts from the uninterrupted one: tokens and logprobs.

A generation cut and continued after a crash re-prefills prompt + prefix in one forward, where the
uninterrupted run decoded the prefix token by token (with a KV cache the matmul shapes differ, so
the logits differ in their last bits). ``measure_prefill_drift`` generates each prompt whole, then
continues it from several cut points (``GenerationRequest.continuation``) and compares the tokens
and the logprobs of the continued part with the whole run's. ``nemo-gym-ckpt bench`` and the
worker README report its numbers; the transformers engine's tests hold it to them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from contextlib import aclosing
from typing import Any

from model_servers.inference_worker.engine import Engine, GenerationRequest, TokenStep

__all__ = ["DRIFT_PROMPTS", "measure_prefill_drift"]

DRIFT_PROMPTS = ("What is 17 times 23?", "Hello there", "The quick brown fox", "42 apples and 7 pears")


async def _run(engine: Engine, request: GenerationRequest) -> list[TokenStep]:
    async with aclosing(engine.generate(request)) as steps:
        return [step async for step in steps]


async def _drifts(
    engine: Engine, prompt: tuple[int, ...], new_tokens: int, cuts: Sequence[int], temperature: float,
    seed: int,
) -> list[tuple[int, list[float]]]:
    """Per cut point: token mismatches and absolute logprob differences of the continued part."""
    whole = GenerationRequest(prompt, new_tokens, seed=seed, temperature=temperature, ignore_eos=True)
    reference = await _run(engine, whole)
    results = []
    for cut in cuts:
        tail = await _run(engine, whole.continuation([step.token_id for step in reference[:cut]]))
        expected = reference[cut:]
        pairs = list(zip(tail, expected, strict=True))
        mismatches = sum(a.token_id != b.token_id for a, b in pairs)
        results.append((mismatches, [abs(a.logprob - b.logprob) for a, b in pairs]))
    return results


async def measure_prefill_drift(
    engine: Engine, *, new_tokens: int = 64, cuts: Sequence[int] = (1, 8, 31, 63), temperature: float = 0.0,
    seed: int = 7, prompts: Sequence[str] = DRIFT_PROMPTS, timeout_s: float = 600.0,
) -> dict[str, Any]:
    """Continue every prompt's generation from every cut point; the worst and mean drift."""
    diffs: list[float] = []
    mismatches = exact = 0
    async with asyncio.timeout(timeout_s):
        for text in prompts:
            prompt = tuple(engine.tokenizer.encode(text))
            for wrong, deltas in await _drifts(engine, prompt, new_tokens, cuts, temperature, seed):
                mismatches += wrong
                exact += max(deltas, default=0.0) == 0.0
                diffs.extend(deltas)
    return {
        "engine": type(engine).__name__, "temperature": temperature, "new_tokens": new_tokens,
        "continuations": len(prompts) * len(cuts), "continued_tokens": len(diffs),
        "token_mismatches": mismatches, "bit_exact_continuations": exact,
        "max_abs_logprob_diff": max(diffs, default=0.0),
        "mean_abs_logprob_diff": sum(diffs) / len(diffs) if diffs else 0.0,
    }
