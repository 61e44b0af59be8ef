"""The generation hold: the engines take no step while held, the hold's rules, and its routes."""

from __future__ import annotations

import asyncio
from contextlib import aclosing
from pathlib import Path

import pytest

from model_servers.inference_worker.engine import Engine, GenerationRequest
from model_servers.inference_worker.generation_hold import REMEMBERED, GenerationHold
from model_servers.inference_worker.tests.conftest import WorkerClient
from model_servers.inference_worker.tests.cut_helpers import AUTH
from model_servers.inference_worker.tests.scripted_engine import ScriptedEngine
from nemo_gym_ckpt.checkpoint.hold_wire import HOLD_ROUTE, HoldRequest, ReleaseRequest

pytestmark = pytest.mark.unit

WAIT_S = 30.0
HELD_S = 0.3


class PausableEngine(ScriptedEngine):
    pausable = True


def hold_of(engine: Engine) -> GenerationHold:
    return GenerationHold(lambda: engine)


def hold(checkpoint_id: str, seconds: float = 60.0) -> HoldRequest:
    return HoldRequest(checkpoint_id=checkpoint_id, seconds=seconds)


def release(checkpoint_id: str) -> ReleaseRequest:
    return ReleaseRequest(checkpoint_id=checkpoint_id)


async def test_the_transformers_engine_takes_no_step_while_paused_and_then_ends_unchanged(
    tiny_model_dir: Path,
) -> None:
    pytest.importorskip("transformers")
    from model_servers.inference_worker.transformers_engine import TransformersEngine

    engine = TransformersEngine.load(tiny_model_dir)
    await engine.start()
    try:
        request = GenerationRequest(tuple(engine.tokenizer.encode("Hello there")), 40, seed=3, ignore_eos=True)
        async with asyncio.timeout(WAIT_S), aclosing(engine.generate(request)) as steps:
            uninterrupted = [step.token_id async for step in steps]
        async with asyncio.timeout(WAIT_S), aclosing(engine.generate(request)) as steps:
            held = [(await anext(steps)).token_id for _ in range(5)]
            engine.pause_generation()
            before = engine.steps
            await asyncio.sleep(HELD_S)
            during = engine.steps - before
            engine.resume_generation()
            held += [step.token_id async for step in steps]
    finally:
        await engine.aclose()
    assert during <= 1  # the step already running when paused, at most
    assert held == uninterrupted


async def test_a_hold_lasts_until_its_release_or_its_expiry_and_a_late_hold_holds_nothing() -> None:
    engine = PausableEngine.from_text("abc")
    holds = hold_of(engine)
    holds.hold(hold("c1"))
    holds.release(release("c0"))  # not the holder: still held
    assert engine.paused and holds.holder == "c1"
    holds.hold(hold("c2"))  # c1's release was lost: c2 takes its place
    holds.release(release("c2"))
    assert not engine.paused and holds.holder is None
    holds.hold(hold("c2"))  # crossed with its release: holds nothing
    assert not engine.paused and holds.status()["late_holds"] == 1
    holds.hold(hold("c3", seconds=0.05))
    await asyncio.sleep(0.3)
    status = holds.status()
    assert not engine.paused and status["held_by"] is None
    assert (status["holds"], status["releases"], status["expired"]) == (2, 1, 1)
    for index in range(REMEMBERED + 1):  # the released ids remembered are bounded
        holds.release(release(f"x{index}"))
    holds.hold(hold("c0", seconds=1))
    assert engine.paused  # c0 was released first of all, and is forgotten by now
    holds.close()
    assert not engine.paused


async def test_a_completion_started_while_held_ends_after_the_release(
    worker_client: WorkerClient, tmp_path: Path
) -> None:
    engine = PausableEngine.from_text("abcdef", pace_s=0.001)
    body = {"prompt": "hi", "max_tokens": 6, "seed": 1}
    async with worker_client(engine, checkpoint=True, staging_dir=str(tmp_path)) as http:
        held = await http.post(HOLD_ROUTE, json={"checkpoint_id": "c1", "seconds": 60}, headers=AUTH)
        completion = asyncio.ensure_future(http.post("/v1/completions", json=body))
        await asyncio.sleep(HELD_S)
        waiting = not completion.done()
        status = await http.get(HOLD_ROUTE, headers=AUTH)
        released = await http.post(f"{HOLD_ROUTE}/release", json={"checkpoint_id": "c1"}, headers=AUTH)
        answer = await asyncio.wait_for(completion, WAIT_S)
    assert held.status_code == 200 and held.json()["held_by"] == "c1"
    assert waiting and status.json()["held_by"] == "c1"
    assert released.json()["held_by"] is None and released.json()["releases"] == 1
    assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == "abcdef"


@pytest.mark.parametrize("body", [
    {"checkpoint_id": "c1"},
    {"checkpoint_id": "c1", "seconds": 0},
    {"checkpoint_id": "c1", "seconds": 121},
    {"checkpoint_id": "c1", "seconds": "5"},
    {"checkpoint_id": "", "seconds": 5},
    {"checkpoint_id": "c" * 257, "seconds": 5},
    {"checkpoint_id": "c1", "seconds": 5, "extra": 1},
], ids=["no-seconds", "zero", "over-the-bound", "string", "empty-id", "long-id", "extra-field"])
async def test_bad_hold_bodies_are_400_and_hold_nothing(
    worker_client: WorkerClient, body: dict[str, object], tmp_path: Path
) -> None:
    engine = PausableEngine.from_text("abc")
    async with worker_client(engine, checkpoint=True, staging_dir=str(tmp_path)) as http:
        reply = await http.post(HOLD_ROUTE, json=body, headers=AUTH)
    assert reply.status_code == 400 and reply.json()["error"]["code"] == "invalid_request"
    assert not engine.paused


async def test_hold_routes_need_the_token_checkpointing_and_an_engine_that_pauses(
    worker_client: WorkerClient, tmp_path: Path
) -> None:
    body = {"checkpoint_id": "c1", "seconds": 5}
    async with worker_client(PausableEngine.from_text("abc"), checkpoint=True, staging_dir=str(tmp_path)) as http:
        missing = await http.post(HOLD_ROUTE, json=body)
        wrong = await http.post(f"{HOLD_ROUTE}/release", json=body, headers={"authorization": "Bearer no"})
        huge = await http.post(HOLD_ROUTE, content=b"{" + b" " * 8192 + b"}", headers=AUTH)
    async with worker_client(ScriptedEngine.from_text("abc"), checkpoint=True, staging_dir=str(tmp_path)) as http:
        cannot = await http.post(HOLD_ROUTE, json=body, headers=AUTH)
    async with worker_client(PausableEngine.from_text("abc"), staging_dir=str(tmp_path)) as http:
        off = await http.post(HOLD_ROUTE, json=body, headers=AUTH)
    assert [r.status_code for r in (missing, wrong, huge, off)] == [401, 401, 413, 404]
    assert cannot.status_code == 400 and "cannot hold" in cannot.json()["error"]["detail"]
