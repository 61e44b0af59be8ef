"""The vLLM engine's contract, on a GPU with vllm installed (``scripts/gpu_check.sh`` runs it).

One engine serves the whole module (vLLM takes a while to start). Settings come from the embedded
default model plus ``NG_VLLM_ARGS`` (JSON, extra ``AsyncEngineArgs``). With ``NG_GPU_REPORT`` set to a
path, the throughput test writes its numbers there as JSON; with ``NG_GPU_CUTS_REPORT``, the
cut-and-continue test writes its table there.

Generation cuts on vLLM: closing a generation's iterator aborts the vLLM request and the tokens
taken so far are the prefix; a continuation sends prompt + prefix ids (``TokensPrompt``), with
``max_tokens`` reduced and the same seed. Through the worker's HTTP layer a cut freezes the tokens
the worker has taken (vLLM goes on) and a later attempt continues them from staging: greedy gives
the uninterrupted tokens; a sampled continuation is a fresh sample after the prefix (vLLM's
per-request generator is stateful), so only the prefix and the length are checked.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import json
import math
import os
import time
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio

from model_servers.inference_worker.app import Config, create_app
from model_servers.inference_worker.engine import Engine, GenerationRequest, TokenStep
from model_servers.inference_worker.throughput import measure_throughput
from nemo_gym_ckpt.config import load_config_dict
from nemo_gym_ckpt.context import ServerContext


def _why_not_runnable() -> str | None:
    if importlib.util.find_spec("vllm") is None:
        return "needs vllm (not installed here: pip install -e '.[vllm]') and a CUDA GPU"
    try:
        importlib.import_module("vllm")
    except ImportError as error:
        return f"needs vllm to import (it failed: {error}) and a CUDA GPU"
    import torch

    if not torch.cuda.is_available():
        return "needs a CUDA GPU (vllm imports, but torch.cuda.is_available() is False)"
    return None


_SKIP_REASON = _why_not_runnable()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(_SKIP_REASON is not None, reason=_SKIP_REASON or ""),
    pytest.mark.asyncio(loop_scope="module"),
    pytest.mark.timeout(300),
]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine() -> AsyncIterator[Engine]:
    from model_servers.inference_worker.vllm_engine import VllmEngine

    extra = {"enforce_eager": True, **json.loads(os.environ.get("NG_VLLM_ARGS", "{}"))}
    loaded = await VllmEngine.load(None, max_batch_size=64, gpu_memory_utilization=0.3, extra_args=extra)
    await loaded.start()
    yield loaded
    await loaded.aclose()


async def run(engine: Engine, request: GenerationRequest) -> list[TokenStep]:
    async with asyncio.timeout(120), aclosing(engine.generate(request)) as steps:
        return [step async for step in steps]


def ids(steps: list[TokenStep]) -> list[int]:
    return [step.token_id for step in steps]


PROMPT = "<bos><|user|>What is 12 plus 30?<|end|><|assistant|>"


def prompt(engine: Engine, text: str = PROMPT) -> tuple[int, ...]:
    return tuple(engine.tokenizer.encode(text))


async def test_greedy_is_repeatable_with_logprobs(engine: Engine) -> None:
    request = GenerationRequest(prompt(engine), 24, seed=0, temperature=0.0, ignore_eos=True)
    first, second = await run(engine, request), await run(engine, request)
    assert ids(first) == ids(second) and len(first) == 24
    assert all(math.isfinite(step.logprob) and step.logprob <= 0 for step in first)
    assert [step.finish_reason for step in first] == [None] * 23 + ["length"]


async def test_greedy_cut_and_continue(engine: Engine) -> None:
    whole = GenerationRequest(prompt(engine), 40, seed=3, temperature=0.0, ignore_eos=True)
    uninterrupted = await run(engine, whole)
    head = await run(engine, GenerationRequest(whole.prompt_token_ids, 15, seed=3, temperature=0.0,
                                               ignore_eos=True))
    tail = await run(engine, whole.continuation(ids(head)))
    assert ids(head + tail) == ids(uninterrupted)


async def test_seeded_sampling(engine: Engine) -> None:
    base = prompt(engine)
    seven = await run(engine, GenerationRequest(base, 30, seed=7, ignore_eos=True))
    again = await run(engine, GenerationRequest(base, 30, seed=7, ignore_eos=True))
    eight = await run(engine, GenerationRequest(base, 30, seed=8, ignore_eos=True))
    assert ids(seven) == ids(again) and ids(seven) != ids(eight)


async def test_stop_token_ends_generation(engine: Engine) -> None:
    base = GenerationRequest(prompt(engine), 12, seed=0, temperature=0.0, ignore_eos=True)
    free = ids(await run(engine, base))
    stopped = await run(engine, replace(base, stop_token_ids=(free[4],)))
    assert ids(stopped) == free[: free.index(free[4]) + 1] and stopped[-1].finish_reason == "stop"


async def test_an_aborted_request_keeps_its_tokens_and_they_continue(engine: Engine) -> None:
    whole = GenerationRequest(prompt(engine), 40, seed=5, temperature=0.0, ignore_eos=True)
    uninterrupted = await run(engine, whole)
    taken: list[TokenStep] = []
    async with aclosing(engine.generate(whole)) as steps:  # closing aborts the vLLM request
        async for step in steps:
            taken.append(step)
            if len(taken) == 17:
                break
    tail = await run(engine, whole.continuation(ids(taken)))
    assert ids(taken + tail) == ids(uninterrupted) and len(tail) == 23


async def test_consumer_stop_aborts_and_engine_goes_on(engine: Engine) -> None:
    taken = []
    request = GenerationRequest(prompt(engine), 200, seed=1, ignore_eos=True)
    async with aclosing(engine.generate(request)) as steps:
        async for step in steps:
            taken.append(step)
            if len(taken) == 3:
                break
    assert len(taken) == 3
    many = await asyncio.gather(*(run(engine, GenerationRequest(prompt(engine), 8, seed=i, ignore_eos=True))
                                  for i in range(16)))
    assert [len(result) for result in many] == [8] * 16


class _Borrowed(Engine):
    """The module's engine lent to an app whose lifespan must not shut it down."""

    def __init__(self, inner: Engine) -> None:
        super().__init__()
        self.inner = inner

    @property
    def tokenizer(self):  # type: ignore[no-untyped-def]
        return self.inner.tokenizer

    @property
    def context_length(self) -> int:
        return self.inner.context_length

    def generate(self, request: GenerationRequest) -> AsyncGenerator[TokenStep, None]:
        return self.inner.generate(request)


async def test_completions_route_over_vllm(engine: Engine) -> None:
    mesh = load_config_dict({"w": {"responses_api_models": {"inference_worker": {"engine": "vllm"}}}})
    settings = mesh.instance("w").settings
    assert isinstance(settings, Config)

    async def lend(_: Config) -> Engine:
        return _Borrowed(engine)

    app = create_app(ServerContext(name="w", settings=settings, mesh=mesh), engine_factory=lend)
    async with app.router.lifespan_context(app), httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://w", timeout=60
    ) as http:
        body = {"prompt": list(prompt(engine)), "max_tokens": 16, "temperature": 0, "return_token_ids": True,
                "logprobs": 1}
        reply = await http.post("/v1/completions", json=body)
    choice = reply.json()["choices"][0]
    assert reply.status_code == 200 and len(choice["token_ids"]) == len(choice["logprobs"]["token_logprobs"])
    assert choice["finish_reason"] in ("stop", "length")


async def test_throughput(engine: Engine) -> None:
    report = await measure_throughput(engine, [1, 8, 32, 64], 128, timeout_s=240)
    assert [row["tokens"] for row in report["results"]] == [128 * b for b in (1, 8, 32, 64)]
    target = os.environ.get("NG_GPU_REPORT")
    if target:
        Path(target).write_text(json.dumps(report))
    print(json.dumps(report))


# ---- generation cuts through the worker's HTTP layer ---------------------------------------------

CUT_AT, CUT_TOTAL = 24, 96


def _cut_app(engine: Engine, staging: Path) -> Any:
    from model_servers.inference_worker.tests.conftest import TOKEN  # the token cut_helpers sends

    mesh = load_config_dict({
        "checkpoint": {"enabled": True, "control_auth_token": TOKEN, "root": str(staging)},
        "w": {"responses_api_models": {"inference_worker": {"engine": "vllm", "staging_dir": str(staging)}}},
    })
    settings = mesh.instance("w").settings
    assert isinstance(settings, Config)

    async def lend(_: Config) -> Engine:
        return engine

    return create_app(ServerContext(name="w", settings=settings, mesh=mesh), engine_factory=lend)


def _request(engine: Engine, temperature: float, n: int) -> dict[str, Any]:
    return {"prompt": list(prompt(engine)), "max_tokens": CUT_TOTAL, "seed": 100 + n, "ignore_eos": True,
            "temperature": temperature, "return_token_ids": True, "logprobs": 1}


async def _cut_case(http: httpx.AsyncClient, gated: Any, engine: Engine, temperature: float, n: int) -> dict:
    """Cut a generation after ``CUT_AT`` tokens, let it finish, continue it as the next attempt."""
    from model_servers.inference_worker.tests.cut_helpers import cut, cut_body, model_call, until_tokens

    body, call = _request(engine, temperature, n), f"mc_gpu{n}"
    running = asyncio.ensure_future(http.post(f"/ng-rollout/g{n}/v1/completions",
                                              json={**body, "model_call": model_call(call)}))
    gated.release(CUT_AT)
    await until_tokens(http, call, CUT_AT)
    receipt = (await cut(http, cut_body(f"c{n}", ("t", f"g{n}", 0, call))))["prefixes"][0]
    gated.release(CUT_TOTAL - CUT_AT)  # exactly the rest: no permit is left for the next request
    uncut = (await running).json()["choices"][0]
    continuation = {"staging_keys": receipt["staging_keys"], "source_call_id": call,
                    "prefix_token_count": CUT_AT, "prefix_digest": receipt["prefix_digest"],
                    "effective_output_limit": CUT_TOTAL}
    began = time.perf_counter()
    gated.release(CUT_TOTAL - CUT_AT)
    again = await http.post(f"/ng-rollout/g{n}-a1/v1/completions", json={
        **body, "model_call": model_call(f"mc_gpu{n}b"), "continuation": continuation})
    return _cut_row(temperature, receipt, uncut, again.json()["choices"][0], time.perf_counter() - began)


def _cut_row(temperature: float, receipt: dict, uncut: dict, continued: dict, seconds: float) -> dict:
    mine, theirs = continued["logprobs"]["token_logprobs"], uncut["logprobs"]["token_logprobs"]
    diffs = [abs(a - b) for a, b in zip(mine, theirs, strict=True) if a is not None and b is not None]
    return {"temperature": temperature, "prefix_tokens": receipt["prefix_token_count"],
            "total_tokens": len(continued["token_ids"]),
            "prefix_kept": continued["token_ids"][:CUT_AT] == uncut["token_ids"][:CUT_AT]
            and mine[:CUT_AT] == theirs[:CUT_AT],
            "tokens_equal_uncut": continued["token_ids"] == uncut["token_ids"],
            "max_abs_logprob_diff": max(diffs, default=0.0), "continued_ms": round(1000 * seconds, 1)}


async def test_cut_and_continue_through_the_worker(engine: Engine, tmp_path: Path) -> None:
    from model_servers.inference_worker.tests.cut_helpers import GatedEngine

    gated = GatedEngine(_Borrowed(engine))
    app = _cut_app(gated, tmp_path)
    async with app.router.lifespan_context(app), httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://w", timeout=120
    ) as http:
        rows = [await _cut_case(http, gated, engine, temperature, n)
                for n, temperature in enumerate((0.0, 0.0, 1.0, 1.0))]
    target = os.environ.get("NG_GPU_CUTS_REPORT")
    if target:
        Path(target).write_text(json.dumps(rows))
    print(json.dumps(rows))
    assert all(row["prefix_kept"] and row["total_tokens"] == CUT_TOTAL for row in rows)
    assert all(row["prefix_tokens"] == CUT_AT for row in rows)
    assert all(row["tokens_equal_uncut"] for row in rows if row["temperature"] == 0.0)
