"""The transformers engine with a real (random-weight) tiny Llama on the CPU."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import aclosing
from pathlib import Path
from typing import Any

import pytest

from model_servers.inference_worker.engine import GenerationRequest, TokenStep
from model_servers.inference_worker.tests.conftest import WorkerClient
from nemo_gym_ckpt.errors import ConfigError, Unavailable

pytest.importorskip("transformers")
from model_servers.inference_worker.transformers_engine import TransformersEngine

pytestmark = pytest.mark.unit


@pytest.fixture(params=[False, True], ids=["full-recompute", "kv-cache"])
async def engine(tiny_model_dir: Path, request: pytest.FixtureRequest) -> AsyncIterator[TransformersEngine]:
    loaded = TransformersEngine.load(tiny_model_dir, max_batch_size=64, kv_cache=request.param)
    await loaded.start()
    yield loaded
    await loaded.aclose()


async def run(engine: TransformersEngine, request: GenerationRequest) -> list[TokenStep]:
    async with asyncio.timeout(30), aclosing(engine.generate(request)) as steps:
        return [step async for step in steps]


def prompt(engine: TransformersEngine, text: str) -> tuple[int, ...]:
    return tuple(engine.tokenizer.encode(text))


def ids(steps: list[TokenStep]) -> list[int]:
    return [step.token_id for step in steps]


async def test_greedy_is_deterministic_and_finishes_by_length(engine: TransformersEngine) -> None:
    request = GenerationRequest(prompt(engine, "Hello there"), 24, seed=0, temperature=0.0, ignore_eos=True)
    first, second = await run(engine, request), await run(engine, request)
    assert ids(first) == ids(second) and len(first) == 24
    assert [step.logprob for step in first] == [step.logprob for step in second]
    assert all(step.logprob < 0 for step in first)
    assert [step.finish_reason for step in first] == [None] * 23 + ["length"]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
async def test_cut_and_continue_equals_uninterrupted(engine: TransformersEngine, temperature: float) -> None:
    whole = GenerationRequest(prompt(engine, "What is 2+3?"), 40, seed=7, temperature=temperature,
                              ignore_eos=True)
    uninterrupted = await run(engine, whole)
    head = await run(engine, GenerationRequest(whole.prompt_token_ids, 15, seed=7, temperature=temperature,
                                               ignore_eos=True))
    continuation = whole.continuation(ids(head))
    assert continuation.max_tokens == 25 and continuation.seed == 7
    tail = await run(engine, continuation)
    assert ids(head + tail) == ids(uninterrupted)
    logprobs = [s.logprob for s in head + tail]
    if engine.kv_cache:  # the continuation prefills what the original decoded: float noise only
        assert logprobs == pytest.approx([s.logprob for s in uninterrupted], abs=1e-4)
    else:
        assert logprobs == [s.logprob for s in uninterrupted]


async def test_seeds_differ_when_sampling(engine: TransformersEngine) -> None:
    base = prompt(engine, "abc")
    seven = await run(engine, GenerationRequest(base, 30, seed=7, ignore_eos=True))
    eight = await run(engine, GenerationRequest(base, 30, seed=8, ignore_eos=True))
    again = await run(engine, GenerationRequest(base, 30, seed=7, ignore_eos=True))
    assert ids(seven) != ids(eight) and ids(seven) == ids(again)


async def test_greedy_tokens_do_not_depend_on_the_batch(engine: TransformersEngine) -> None:
    texts = ["a", "Hello", "What is 97 times 53?", "x" * 30, "The quick brown fox", "42", "ok then",
             "<|user|>hi"]
    requests = [GenerationRequest(prompt(engine, t), 20, seed=i, temperature=0.0, ignore_eos=True)
                for i, t in enumerate(texts)]
    alone = [ids(await run(engine, request)) for request in requests]
    steps_before = engine.steps
    together = await asyncio.gather(*(run(engine, request) for request in requests))
    assert [ids(result) for result in together] == alone
    assert engine.steps - steps_before <= 21, "the 8 requests must share decode steps"


async def test_sixteen_concurrent_requests_complete(tiny_model_dir: Path) -> None:
    engine = TransformersEngine.load(tiny_model_dir, max_batch_size=4)
    await engine.start()
    try:
        requests = [GenerationRequest(prompt(engine, f"q{i}"), 6 + i % 3, seed=i, ignore_eos=True)
                    for i in range(16)]
        results = await asyncio.gather(*(run(engine, request) for request in requests))
    finally:
        await engine.aclose()
    assert [len(result) for result in results] == [request.max_tokens for request in requests]
    assert 28 <= engine.steps <= 40, "batches of at most 4, new requests joining as others finish"


async def test_stop_tokens_end_the_generation(engine: TransformersEngine) -> None:
    base = GenerationRequest(prompt(engine, "Hello"), 12, seed=0, temperature=0.0, ignore_eos=True)
    free = ids(await run(engine, base))
    stop_at = free[4]
    stopped = await run(engine, GenerationRequest(base.prompt_token_ids, 12, seed=0, temperature=0.0,
                                                  ignore_eos=True, stop_token_ids=(stop_at,)))
    cut = free.index(stop_at) + 1
    assert ids(stopped) == free[:cut] and stopped[-1].finish_reason == "stop"


async def test_a_consumer_that_stops_frees_its_slot(engine: TransformersEngine) -> None:
    request = GenerationRequest(prompt(engine, "Hello"), 200, seed=1, ignore_eos=True)
    taken = []
    async with aclosing(engine.generate(request)) as steps:
        async for step in steps:
            taken.append(step)
            if len(taken) == 3:
                break
    assert len(taken) == 3 and engine.active_count == 0
    async with asyncio.timeout(10):
        while engine.active_count:
            await asyncio.sleep(0.005)
    steps_after_cancel = engine.steps
    assert len(await run(engine, GenerationRequest(request.prompt_token_ids, 2, seed=1))) >= 1
    assert engine.steps - steps_after_cancel <= 3


async def test_shutdown_fails_waiting_requests(tiny_model_dir: Path) -> None:
    engine = TransformersEngine.load(tiny_model_dir)
    with pytest.raises(Unavailable):
        await run(engine, GenerationRequest((5, 6), 3, seed=0))
    await engine.start()
    request = GenerationRequest((5, 6), 200, seed=0, ignore_eos=True)
    async with aclosing(engine.generate(request)) as steps:
        await anext(steps)
        await engine.aclose()
        with pytest.raises(Unavailable, match="shut down"):
            async with asyncio.timeout(10):
                async for _ in steps:
                    pass


async def test_kv_cache_draws_what_full_recompute_draws(tiny_model_dir: Path) -> None:
    texts = ["a", "Hello", "What is 97 times 53?", "x" * 30, "The quick", "42", "ok then", "<|user|>hi"] * 2
    results = []
    for kv_cache in (False, True):
        engine = TransformersEngine.load(tiny_model_dir, max_batch_size=3, kv_cache=kv_cache)
        await engine.start()
        requests = [GenerationRequest(prompt(engine, t), 10 + i, seed=i, temperature=[0.0, 1.0][i % 2],
                                      top_p=[1.0, 0.9][i % 3 == 0], ignore_eos=True)
                    for i, t in enumerate(texts)]
        try:
            results.append(await asyncio.gather(*(run(engine, request) for request in requests)))
        finally:
            await engine.aclose()
    full, cached = results
    assert [ids(result) for result in cached] == [ids(result) for result in full]
    full_logprobs = [s.logprob for r in full for s in r]
    assert [s.logprob for r in cached for s in r] == pytest.approx(full_logprobs, abs=1e-4)


def test_context_length_and_its_limit(tiny_model_dir: Path) -> None:
    assert TransformersEngine.load(tiny_model_dir).context_length == 256
    assert TransformersEngine.load(tiny_model_dir, max_model_len=100).context_length == 100
    with pytest.raises(ConfigError, match="exceeds the model's 256 positions"):
        TransformersEngine.load(tiny_model_dir, max_model_len=1000)


async def test_a_dead_scheduler_refuses_new_requests_and_fails_health(
    tiny_model_dir: Path, worker_client: WorkerClient
) -> None:
    engine = TransformersEngine.load(tiny_model_dir)
    real = engine._stepper.logits

    def fails_once(batch: Any) -> Any:
        engine._stepper.logits = real
        raise KeyError("injected: an error a step does not catch")

    engine._stepper.logits = fails_once  # type: ignore[method-assign]
    body = {"prompt": [5, 6, 7], "max_tokens": 3}
    async with worker_client(engine) as http:
        first = await http.post("/v1/completions", json=body)
        assert first.status_code == 500 and "scheduler died" in first.json()["error"]["detail"]
        async with asyncio.timeout(10):  # before the fix: queued behind the dead scheduler for good
            second = await http.post("/v1/completions", json=body)
        health = await http.get("/health")
    assert second.status_code == 503 and second.json()["error"]["code"] == "unavailable"
    assert "KeyError" in second.json()["error"]["detail"]
    assert health.status_code == 503 and "KeyError" in health.json()["error"]["detail"]
