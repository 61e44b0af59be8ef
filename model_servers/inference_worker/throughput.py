"""Generation throughput of a started engine, for ``nemo-gym-ckpt bench``.

``await measure_throughput(engine, [1, 8, 32, 64], 64)`` runs, for each batch size, that many
concurrent requests of exactly ``new_tokens`` tokens (``ignore_eos``, sampled at temperature 1, one
seed each) and reports aggregate tokens per second.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from contextlib import aclosing
from typing import Any

from model_servers.inference_worker.engine import Engine, GenerationRequest

__all__ = ["DEFAULT_PROMPT", "measure_throughput"]

DEFAULT_PROMPT = "What is 17 times 23?"


async def _count_tokens(engine: Engine, request: GenerationRequest) -> int:
    count = 0
    async with aclosing(engine.generate(request)) as steps:
        async for _ in steps:
            count += 1
    return count


async def _run_batch(
    engine: Engine, prompt: tuple[int, ...], batch_size: int, new_tokens: int
) -> dict[str, Any]:
    requests = [GenerationRequest(prompt, new_tokens, seed=i, ignore_eos=True) for i in range(batch_size)]
    started = time.perf_counter()
    counts = await asyncio.gather(*(_count_tokens(engine, request) for request in requests))
    seconds = time.perf_counter() - started
    tokens = sum(counts)
    return {"batch_size": batch_size, "new_tokens": new_tokens, "tokens": tokens,
            "seconds": round(seconds, 4), "tokens_per_s": round(tokens / seconds, 1)}


async def measure_throughput(
    engine: Engine, batch_sizes: Sequence[int], new_tokens: int, *, timeout_s: float = 600.0
) -> dict[str, Any]:
    """Tokens/s of ``engine`` (already started) per batch size; the whole run bounded by ``timeout_s``."""
    prompt = tuple(engine.tokenizer.encode(DEFAULT_PROMPT))
    if len(prompt) + new_tokens > engine.context_length:
        raise ValueError(f"new_tokens={new_tokens} does not fit the context of {engine.context_length}")
    async with asyncio.timeout(timeout_s):
        await _run_batch(engine, prompt, 1, 2)
        results = [await _run_batch(engine, prompt, size, new_tokens) for size in batch_sizes]
    return {"engine": type(engine).__name__, "context_length": engine.context_length,
            "prompt_tokens": len(prompt), "results": results}
