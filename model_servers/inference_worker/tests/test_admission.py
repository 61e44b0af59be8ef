"""The worker holds at most ``max_batch_size + max_waiting_requests`` completions; the next is
refused up front (429 ``capacity_exceeded`` with ``Retry-After``) and nothing of it is started."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from starlette.requests import ClientDisconnect

from model_servers.inference_worker.admission import DEFAULT_MAX_WAITING, Admission
from model_servers.inference_worker.app import Config, _HeldStream
from model_servers.inference_worker.tests.conftest import WorkerClient, make_ctx
from model_servers.inference_worker.tests.scripted_engine import CharTokenizer, ScriptedEngine
from nemo_gym_ckpt.errors import Overloaded

pytestmark = pytest.mark.unit

HELLO = CharTokenizer().encode("Hello")
CHAT = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2}
WAIT_S = 5.0


async def _admitted(engine: ScriptedEngine, count: int) -> None:
    async with asyncio.timeout(WAIT_S):
        while len(engine.admitted) < count:
            await asyncio.sleep(0.01)


def _assert_refused(reply: httpx.Response, retry_after: str) -> None:
    assert reply.status_code == 429, reply.text
    assert reply.json()["error"]["code"] == "capacity_exceeded"
    assert "max_waiting_requests" in reply.json()["error"]["detail"]
    assert reply.headers["retry-after"] == retry_after


async def test_a_completion_past_the_bound_is_refused_up_front(worker_client: WorkerClient) -> None:
    engine = ScriptedEngine.from_text("ab", gated=True)
    async with worker_client(engine, max_batch_size=1, max_waiting_requests=1, overload_retry_after_s=3) as http:
        first = asyncio.ensure_future(http.post("/v1/completions", json={"prompt": HELLO, "max_tokens": 2}))
        second = asyncio.ensure_future(http.post("/v1/chat/completions", json=CHAT))
        await _admitted(engine, 2)  # one generating, one waiting
        _assert_refused(await http.post("/v1/completions", json={"prompt": HELLO, "max_tokens": 2}), "3")
        _assert_refused(await http.post("/v1/chat/completions", json={**CHAT, "stream": True}), "3")
        assert len(engine.admitted) == 2  # the refused ones never reached the engine
        engine.release(5)  # two tokens each, and one for the next
        assert [(await first).status_code, (await second).status_code] == [200, 200]
        again = await http.post("/v1/completions", json={"prompt": HELLO, "max_tokens": 1})
    assert again.status_code == 200, again.text


async def test_a_stream_holds_its_place_until_it_ends(worker_client: WorkerClient) -> None:
    engine = ScriptedEngine.from_text("ab", gated=True)
    async with worker_client(engine, max_batch_size=1, max_waiting_requests=0) as http:
        streamed = asyncio.ensure_future(
            http.post("/v1/completions", json={"prompt": HELLO, "max_tokens": 2, "stream": True}))
        await _admitted(engine, 1)
        engine.release(1)  # its first token is out; the stream is still on
        _assert_refused(await http.post("/v1/completions", json={"prompt": HELLO}), "1")
        engine.release(2)
        assert (await streamed).text.endswith("data: [DONE]\n\n")
        after = await http.post("/v1/completions", json={"prompt": HELLO, "max_tokens": 1})
    assert after.status_code == 200, after.text


async def test_a_refused_place_is_freed_by_errors_too(worker_client: WorkerClient) -> None:
    engine = ScriptedEngine.from_text("ab")
    async with worker_client(engine, max_batch_size=1, max_waiting_requests=0) as http:
        for _ in range(3):  # a 400 after admission (ids outside the vocabulary) gives its place back
            assert (await http.post("/v1/completions", json={"prompt": [10_000]})).status_code == 400
        ok = await http.post("/v1/completions", json={"prompt": HELLO, "max_tokens": 1})
    assert ok.status_code == 200, ok.text


async def test_a_stream_whose_client_left_before_it_began_gives_its_place_back() -> None:
    admission = Admission(1)
    began = False

    async def events() -> AsyncIterator[bytes]:
        nonlocal began
        began = True
        yield b"data: [DONE]\n\n"

    async def gone(message: Any) -> None:
        raise OSError("the client went away")

    async def receive() -> dict[str, Any]:
        return {"type": "http.disconnect"}

    response = _HeldStream(events(), admission.hold())
    with pytest.raises(ClientDisconnect):
        await response({"type": "http", "asgi": {"spec_version": "2.4"}}, receive, gone)
    assert not began and admission.held == 0
    with admission.hold(), pytest.raises(Overloaded):
        admission.hold()
    assert admission.refused == 1 and admission.held == 0


def test_the_bound_is_configured_with_a_default() -> None:
    settings = make_ctx().settings
    assert isinstance(settings, Config)
    assert (settings.max_waiting_requests, settings.overload_retry_after_s) == (DEFAULT_MAX_WAITING, 1.0)
    assert make_ctx(max_waiting_requests=None).settings.max_waiting_requests is None
