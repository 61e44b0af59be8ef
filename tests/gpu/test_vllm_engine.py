"""The vLLM engine's contract, on a GPU with vllm installed (``scripts/gpu_check.sh`` runs it).

One engine serves the whole module (vLLM takes a while to start). Settings come from the embedded
default model plus ``NG_VLLM_ARGS`` (JSON, extra ``AsyncEngineArgs``). With ``NG_GPU_REPORT`` set to a
path, the throughput test writes its numbers there as JSON.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import json
import math
import os
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from dataclasses import replace
from pathlib import Path

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
    mesh = load_config_dict({"w": {"model_servers": {"inference_worker": {"engine": "vllm"}}}})
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
