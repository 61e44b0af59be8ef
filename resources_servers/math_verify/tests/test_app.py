"""math_verify over httpx.ASGITransport (lifespan run): grading, the deadline, bad input."""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from nemo_gym_ckpt.config import load_config_dict
from nemo_gym_ckpt.context import ServerContext
from resources_servers.math_verify.app import create_app
from resources_servers.math_verify.grader import Grade, GraderPool
from resources_servers.math_verify.tests.grade_functions import (
    crash,
    dies_grading,
    dies_on_its_first_grade,
    no_warm_up,
    same,
    slow_start,
    stuck_on_stuck,
)

pytestmark = pytest.mark.unit

PATHOLOGICAL = "$\\boxed{10^{10^{10}}+1}$"  # sympy evaluates this for minutes


def answer(text: str) -> dict[str, Any]:
    message = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": text}]}
    return {"output": [message]}


@pytest.fixture
async def make_client() -> AsyncIterator[Callable[..., Any]]:
    """Clients of apps built by create_app, their lifespan (the worker pool) run and closed."""
    stack: list[tuple[ServerContext[Any], Any]] = []

    async def make(**settings: Any) -> httpx.AsyncClient:
        mesh = load_config_dict({"mv": {"resources_servers": {"math_verify": settings}}})
        ctx: ServerContext[Any] = ServerContext("mv", mesh.instance("mv").settings, mesh)
        app = create_app(ctx)
        lifespan = app.router.lifespan_context(app)
        await lifespan.__aenter__()
        stack.append((ctx, lifespan))
        return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://mv")

    yield make
    for ctx, lifespan in stack:
        await lifespan.__aexit__(None, None, None)
        await ctx.aclose()


async def verify(http: httpx.AsyncClient, text: str, expected: Any) -> dict[str, Any]:
    reply = await http.post("/verify", json={"expected_answer": expected, "response": answer(text)})
    assert reply.status_code == 200, reply.text
    return dict(reply.json())


async def test_grades_with_math_verify(make_client: Callable[..., Any]) -> None:
    http = await make_client()
    cases = [
        ("The answer is $42$.", 42, 1.0),
        ("so \\boxed{0.5}", "\\frac{1}{2}", 1.0),
        ("$\\boxed{\\frac{2}{4}}$", "$\\frac{1}{2}$", 1.0),
        ("$\\boxed{(x+1)^2}$", "x^2+2x+1", 1.0),
        ("The answer is $43$.", 42, 0.0),
        ("I cannot tell.", 7, 0.0),
        ("", 2.5, 0.0),
    ]
    for text, expected, reward in cases:
        body = await verify(http, text, expected)
        assert (body["reward"], body["grade_status"]) == (reward, "ok"), (text, expected, body)
    body = await verify(http, "The answer is $42$.", 42)
    assert (body["expected_answer"], body["extracted_answer"]) == (42, "42")


async def test_pathological_answer_times_out_and_server_stays_up(make_client: Callable[..., Any]) -> None:
    http = await make_client(timeout_s=3.0, workers=1)
    stuck = asyncio.create_task(verify(http, PATHOLOGICAL, 1))
    assert (await http.get("/health")).status_code == 200
    assert not stuck.done()
    body = await stuck
    assert (body["reward"], body["grade_status"], body["extracted_answer"]) == (0.0, "timeout", None)
    body = await verify(http, "$\\boxed{3}$", 3)
    assert (body["reward"], body["grade_status"]) == (1.0, "ok")


async def test_only_the_tail_of_the_answer_is_read(make_client: Callable[..., Any]) -> None:
    http = await make_client(max_answer_chars=12)
    body = await verify(http, PATHOLOGICAL + " " * 40 + "$\\boxed{7}$", 7)
    assert (body["reward"], body["grade_status"]) == (1.0, "ok")


async def test_a_dead_worker_is_replaced() -> None:
    pool = GraderPool(workers=1, timeout_s=30.0, grade=crash, warm_up=no_warm_up)
    try:
        assert (await pool.grade("1", "1")).status == "worker_died"
        assert pool.live_workers == 0
        assert (await pool.grade("1", "1")).status == "worker_died"
    finally:
        await pool.aclose()


async def test_a_worker_that_died_while_idle_is_replaced_and_the_answer_graded() -> None:
    pool = GraderPool(workers=1, timeout_s=30.0, grade=same, warm_up=no_warm_up)
    try:
        assert await pool.grade("7", "7") == Grade("ok", True, "7")
        idle = pool._idle[0].process
        idle.kill()  # the OOM killer, a stray SIGKILL
        idle.join(5.0)
        assert await pool.grade("8", "8") == Grade("ok", True, "8")
        assert pool.live_workers == 1
    finally:
        await pool.aclose()


async def test_a_grade_that_cannot_be_sent_is_graded_on_a_new_worker() -> None:
    pool = GraderPool(workers=1, timeout_s=30.0, grade=same, warm_up=no_warm_up)
    try:
        assert await pool.grade("7", "7") == Grade("ok", True, "7")
        idle = pool._idle[0].process
        idle.kill()
        idle.join(5.0)
        idle.is_alive = lambda: True  # type: ignore[method-assign]  # it dies just after we look
        assert await pool.grade("8", "8") == Grade("ok", True, "8")
        assert pool.live_workers == 1
    finally:
        await pool.aclose()


async def test_a_worker_that_dies_after_the_grade_was_sent_is_replaced_and_the_grade_tried_once_more(
    tmp_path: Path,
) -> None:
    """The send went into the pipe, then the worker died without answering (a stray SIGKILL just after
    our look at it, as the reply is awaited): one more try on a new worker, not ``worker_died``."""
    marker = str(tmp_path / "died")
    pool = GraderPool(workers=1, timeout_s=30.0, grade=dies_on_its_first_grade, warm_up=no_warm_up)
    try:
        assert await pool.grade(marker, "9") == Grade("ok", True, "9")
        assert os.path.exists(marker) and pool.live_workers == 1
    finally:
        await pool.aclose()


async def test_an_answer_that_kills_its_worker_while_grading_costs_one_worker() -> None:
    pool = GraderPool(workers=1, timeout_s=30.0, grade=dies_grading, warm_up=no_warm_up)
    spawned: list[object] = []
    take = pool._take_worker

    async def counted() -> Any:
        worker = await take()
        spawned.append(worker)
        return worker

    pool._take_worker = counted  # type: ignore[method-assign]
    try:
        assert await pool.grade("1", "1") == Grade("worker_died")
        assert len(spawned) == 1
    finally:
        await pool.aclose()


async def test_a_grade_in_flight_at_the_close_starts_no_worker_after_it() -> None:
    pool = GraderPool(workers=1, timeout_s=30.0, grade=stuck_on_stuck, warm_up=no_warm_up)
    try:
        assert await pool.grade("1", "1") == Grade("ok", True, "1")
        stuck = asyncio.create_task(pool.grade("1", "stuck"))
        for _ in range(200):  # until the grade is on its worker (bounded)
            if pool._busy:
                break
            await asyncio.sleep(0.01)
        await pool.aclose()
        async with asyncio.timeout(30):
            assert await stuck == Grade("worker_died")
        assert pool.live_workers == 0
    finally:
        await pool.aclose()


async def test_a_close_while_a_grade_reaps_a_dead_worker_starts_no_worker_after_it() -> None:
    others = set(multiprocessing.active_children())
    pool = GraderPool(workers=1, timeout_s=30.0, grade=same)
    try:
        assert await pool.grade("1", "1") == Grade("ok", True, "1")
        idle = pool._idle[0].process
        idle.kill()  # dead while idle: the next grade reaps it first
        idle.join(5.0)
        grade = asyncio.create_task(pool.grade("2", "2"))
        await asyncio.sleep(0)  # the grade now waits on the dead worker's stop
        await pool.aclose()
        async with asyncio.timeout(30):
            assert await grade == Grade("worker_died")
        assert pool.live_workers == 0 and set(multiprocessing.active_children()) <= others
    finally:
        await pool.aclose()


async def test_grades_beyond_the_loops_thread_pool_wait_on_their_own() -> None:
    """More grades in flight than the event loop's default executor has threads: a stuck grade's
    wait must not hold up another grade's (the waits used to run in that executor, one per thread,
    so the stuck one's deadline ran out before the next grade's wait even started)."""
    asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(max_workers=1))
    timeout_s = 10.0
    pool = GraderPool(workers=2, timeout_s=timeout_s, grade=stuck_on_stuck, warm_up=no_warm_up)
    try:
        assert await asyncio.gather(pool.grade("1", "1"), pool.grade("2", "2")) == [Grade("ok", True, "1"),
                                                                                    Grade("ok", True, "2")]
        stuck = asyncio.create_task(pool.grade("1", "stuck"))
        await asyncio.sleep(0)  # the stuck grade is sent and its wait begun
        quick = asyncio.create_task(pool.grade("3", "3"))
        done, _ = await asyncio.wait({stuck, quick}, timeout=2 * timeout_s, return_when=asyncio.FIRST_COMPLETED)
        assert done == {quick}
        assert quick.result() == Grade("ok", True, "3")
        assert pool.live_workers == 2  # the stuck grade is still waiting within its deadline
        stuck.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await stuck
    finally:
        await pool.aclose()


async def test_a_workers_start_is_not_charged_to_the_grade() -> None:
    pool = GraderPool(workers=1, timeout_s=0.5, grade=same, warm_up=slow_start)
    try:
        assert await pool.grade("7", "7") == Grade("ok", True, "7")
        assert pool.live_workers == 1
    finally:
        await pool.aclose()


async def test_a_worker_that_does_not_start_in_time_is_given_up() -> None:
    pool = GraderPool(workers=1, timeout_s=30.0, grade=same, warm_up=slow_start, start_timeout_s=0.2)
    try:
        assert (await pool.grade("7", "7")).status == "worker_died"
        assert pool.live_workers == 0
    finally:
        await pool.aclose()


@pytest.mark.parametrize(
    "row",
    [
        {"expected_answer": "", "response": {"output": []}},
        {"expected_answer": True, "response": {"output": []}},
        {"expected_answer": None, "response": {"output": []}},
        {"expected_answer": [1], "response": {"output": []}},
        {"response": {"output": []}},
        {"expected_answer": "1"},
        {"expected_answer": "1", "response": None},
    ],
)
async def test_bad_verify_bodies_are_400(make_client: Callable[..., Any], row: dict[str, Any]) -> None:
    http = await make_client()
    reply = await http.post("/verify", json=row)
    assert (reply.status_code, reply.json()["error"]["code"]) == (400, "invalid_request")


async def test_garbage_and_seed(make_client: Callable[..., Any]) -> None:
    http = await make_client()
    reply = await http.post("/verify", content=b"{{", headers={"content-type": "application/json"})
    assert (reply.status_code, reply.json()["error"]["code"]) == (400, "invalid_request")
    reply = await http.post("/seed_session", json={"expected_answer": "1"})
    assert reply.headers["x-ng-checkpoint-verify"] == "replay"
    assert "x-ng-checkpoint-restart" not in reply.headers
    assert (await http.get("/tools")).json() == []
