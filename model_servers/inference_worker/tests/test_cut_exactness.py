"""Cut and continue on the real transformers engine (tiny random Llama), through the worker's HTTP.

A generation is cut at a chosen token (the gate holds the rest), finishes uncut, and is continued
from its staged prefix as a later attempt: greedy and seeded sampling give the very same tokens;
the prefix's logprobs come from staging; the continued part's are bit-equal without a KV cache and
within float noise with one (``prefill_drift`` measures how far).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from model_servers.inference_worker.prefill_drift import measure_prefill_drift
from model_servers.inference_worker.tests.conftest import WorkerClient
from model_servers.inference_worker.tests.cut_helpers import (
    GatedEngine,
    complete_under,
    cut,
    cut_body,
    model_call,
    start_under,
    until_tokens,
)

pytest.importorskip("transformers")
from model_servers.inference_worker.transformers_engine import TransformersEngine

pytestmark = pytest.mark.unit

KV_NOISE = 1e-4  # the bound the README states for a KV-cache continuation's logprobs
CUT_AT = 15


@pytest.fixture(params=[False, True], ids=["full-recompute", "kv-cache"])
async def engine(tiny_model_dir: Path, request: pytest.FixtureRequest) -> AsyncIterator[GatedEngine]:
    yield GatedEngine(TransformersEngine.load(tiny_model_dir, max_batch_size=8, kv_cache=request.param))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
async def test_a_continued_generation_equals_the_uncut_one(
    worker_client: WorkerClient, engine: GatedEngine, tmp_path: Path, temperature: float
) -> None:
    kv_cache = isinstance(engine.inner, TransformersEngine) and engine.inner.kv_cache
    async with worker_client(engine, checkpoint=True, staging_dir=str(tmp_path)) as http:
        prompt = engine.tokenizer.encode("What is 2+3?")
        body = {"prompt": prompt, "max_tokens": 40, "seed": 7, "temperature": temperature, "ignore_eos": True,
                "return_token_ids": True, "logprobs": 1}
        running = start_under(http, "r1", {**body, "model_call": model_call("mc_a")})
        engine.release(CUT_AT)
        await until_tokens(http, "mc_a", CUT_AT)
        receipt = (await cut(http, cut_body("c1", ("tk-1", "r1", 0, "mc_a"))))["prefixes"][0]
        engine.open_gate()
        uncut = (await running).json()["choices"][0]
        continuation = {"staging_keys": receipt["staging_keys"], "source_call_id": "mc_a",
                        "prefix_token_count": CUT_AT, "prefix_digest": receipt["prefix_digest"],
                        "effective_output_limit": 40}  # the whole output budget, as upstream
        again = await complete_under(http, "r1-a1", {**body, "model_call": model_call("mc_b"),
                                                     "continuation": continuation})
    continued = again.json()["choices"][0]
    assert continued["token_ids"] == uncut["token_ids"] and len(uncut["token_ids"]) == 40
    assert engine.admitted[-1].prompt_token_ids == (*prompt, *uncut["token_ids"][:CUT_AT])
    mine, theirs = continued["logprobs"]["token_logprobs"], uncut["logprobs"]["token_logprobs"]
    assert mine[:CUT_AT] == theirs[:CUT_AT]  # the prefix's logprobs come from staging, exactly
    if kv_cache:
        assert mine[CUT_AT:] == pytest.approx(theirs[CUT_AT:], abs=KV_NOISE)
    else:
        assert mine[CUT_AT:] == theirs[CUT_AT:]


async def test_prefill_drift_is_zero_without_a_cache_and_float_noise_with_one(tiny_model_dir: Path) -> None:
    reports = {}
    for kv_cache in (False, True):
        engine = TransformersEngine.load(tiny_model_dir, max_batch_size=8, kv_cache=kv_cache)
        await engine.start()
        try:
            reports[kv_cache] = await measure_prefill_drift(engine, new_tokens=24, cuts=(1, 12, 23),
                                                            prompts=("Hello there", "abc"), timeout_s=60)
        finally:
            await engine.aclose()
    exact, cached = reports[False], reports[True]
    assert exact["token_mismatches"] == 0 and exact["max_abs_logprob_diff"] == 0.0
    assert exact["bit_exact_continuations"] == exact["continuations"] == 6
    assert cached["token_mismatches"] == 0 and 0.0 <= cached["max_abs_logprob_diff"] < KV_NOISE
