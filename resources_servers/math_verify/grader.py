"""Grading with ``math-verify`` in worker processes, each grade under a deadline.

``math_verify``'s own timeouts use ``signal.alarm``, which only works on the main thread, and a
thread cannot be stopped: one pathological answer (``10^{10^{10}}``) would pin a thread and a core
for good. So grades run in a small pool of worker processes (spawned, started on first use). A
grade that overruns its deadline gets its worker killed and replaced, and comes back as
``"timeout"``; a worker that dies mid-grade comes back as ``"worker_died"``. The server never
waits longer than the deadline for one grade, and a stuck input never outlives it.

A grade waits for its worker's reply on the event loop itself (a reader on the pipe and an asyncio
deadline), not in a thread: waits queued behind a thread pool smaller than ``workers`` would start
their deadlines late. A worker that died while idle (the OOM killer, a stray ``SIGKILL``) is replaced
before it is handed a grade; if the grade still cannot be sent to it (it died just then), a new
worker takes the grade once more.

A worker's start (a new interpreter importing ``math_verify`` and sympy: seconds on a busy machine)
is not charged to a grade: a new worker says it is ready once its imports are done, and only then
gets a grade and its deadline. A worker not ready within ``START_TIMEOUT_S`` is killed and its grade
comes back as ``"worker_died"``. Otherwise the answer graded right after a timeout (whose worker was
replaced) would time out too on a loaded machine, and a correct answer would get reward 0.0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Literal

__all__ = ["START_TIMEOUT_S", "Grade", "GradeStatus", "GraderPool", "grade_answer", "load_math_verify"]

GradeStatus = Literal["ok", "timeout", "worker_died"]
GradeFn = Callable[[str, str], tuple[bool, str | None]]
WarmUp = Callable[[], None]
START_TIMEOUT_S = 60.0
"""How long a new worker may take to import what it grades with before it is given up."""
_READY = "ready"


@dataclass(frozen=True)
class Grade:
    status: GradeStatus
    correct: bool = False
    extracted: str | None = None


def grade_answer(expected: str, text: str) -> tuple[bool, str | None]:
    """Whether ``text`` states ``expected`` (math-verify), and what it was read as."""
    from math_verify import parse, verify

    latex = expected if "$" in expected or "\\boxed" in expected else f"${expected}$"
    gold = parse(latex, parsing_timeout=None)
    answer = parse(text, parsing_timeout=None)
    extracted = str(answer[-1]) if answer else None
    return bool(gold and answer and verify(gold, answer, timeout_seconds=None)), extracted


def load_math_verify() -> None:
    """Import what ``grade_answer`` uses (a worker's warm-up, before it says it is ready)."""
    import math_verify  # noqa: F401


def _serve(conn: Connection, grade: GradeFn, warm_up: WarmUp) -> None:
    """A worker's loop: ready once warmed up, then (expected, text) in, grade out, until ``None``
    or the parent is gone."""
    # the deadline is ours (see above): math-verify's "timeout is disabled" and parse-failure
    # warnings are expected here and would only flood the server log
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    with conn:
        warm_up()
        conn.send(_READY)
        while True:
            try:
                job = conn.recv()
            except EOFError:
                return
            if job is None:
                return
            conn.send(grade(*job))


_DIED_ON_ARRIVAL_S = 0.25
"""A worker whose pipe ends this soon after the send died as the grade reached it (a stray kill just
after our look at it: the send can still succeed); one that dies later died grading: ``worker_died``."""


class _NotDelivered(Exception):
    """The worker was gone before it could grade; the grade is tried once more on a new worker."""


async def _readable(fd: int, timeout_s: float) -> bool:
    """Whether ``fd`` becomes readable within ``timeout_s`` (a reply on a worker's pipe, the end of a
    dead worker's pipe, an exited process's sentinel). Waits on the event loop, holding no thread."""
    loop = asyncio.get_running_loop()
    signalled = loop.create_future()

    def wake() -> None:
        if not signalled.done():
            signalled.set_result(None)

    loop.add_reader(fd, wake)
    try:
        async with asyncio.timeout(timeout_s):
            await signalled
        return True
    except TimeoutError:
        return False
    finally:
        loop.remove_reader(fd)


class _Worker:
    """One worker process and the parent's end of its pipe."""

    def __init__(self, grade: GradeFn, warm_up: WarmUp) -> None:
        context = multiprocessing.get_context("spawn")
        self.conn, child = context.Pipe()
        self.process: BaseProcess = context.Process(
            target=_serve, args=(child, grade, warm_up), name="math-verify-worker", daemon=True
        )
        self.process.start()
        child.close()
        self.warmed = False

    async def ready(self, timeout_s: float) -> bool:
        """Whether the worker has finished its warm-up, waiting up to ``timeout_s`` for a new one."""
        if not self.warmed:
            try:
                self.warmed = await _readable(self.conn.fileno(), timeout_s) and self.conn.recv() == _READY
            except (EOFError, OSError):
                return False
        return self.warmed

    async def grade(self, expected: str, text: str, timeout_s: float) -> Grade:
        """The worker's grade; raises ``_NotDelivered`` when the worker was gone as the grade reached it."""
        try:
            self.conn.send((expected, text))
        except OSError as error:
            raise _NotDelivered from error
        sent = asyncio.get_running_loop().time()
        if not await _readable(self.conn.fileno(), timeout_s):
            return Grade("timeout")
        try:
            correct, extracted = self.conn.recv()
        except (EOFError, OSError) as error:
            if asyncio.get_running_loop().time() - sent <= _DIED_ON_ARRIVAL_S:
                raise _NotDelivered from error
            return Grade("worker_died")  # it died grading: this answer gets no second worker
        return Grade("ok", correct, extracted)

    async def stop(self) -> None:
        """Kill the worker and reap it once it has exited (up to 5 s), holding no thread meanwhile."""
        self.process.kill()
        if await _readable(self.process.sentinel, 5.0):
            self.process.join(1.0)  # it has exited: this only collects its status
        self.conn.close()


class GraderPool:
    """At most ``workers`` grades at once, each bounded by ``timeout_s``."""

    def __init__(
        self, workers: int, timeout_s: float, grade: GradeFn = grade_answer, warm_up: WarmUp = load_math_verify,
        start_timeout_s: float = START_TIMEOUT_S,
    ) -> None:
        self.timeout_s, self.start_timeout_s = timeout_s, start_timeout_s
        self._grade, self._warm_up = grade, warm_up
        self._slots = asyncio.Semaphore(workers)
        self._idle: list[_Worker] = []
        self._busy: set[_Worker] = set()
        self._closed = False

    async def grade(self, expected: str, text: str) -> Grade:
        async with self._slots:
            for _ in range(2):  # a worker that died between our look at it and the send: once more
                if self._closed:
                    break  # no worker is started for a pool that is closed
                try:
                    return await self._grade_on_a_worker(expected, text)
                except _NotDelivered:
                    continue
            return Grade("worker_died")

    async def _grade_on_a_worker(self, expected: str, text: str) -> Grade:
        worker = await self._take_worker()
        if worker is None:
            return Grade("worker_died")
        self._busy.add(worker)
        result: Grade | None = None
        try:
            if not await worker.ready(self.start_timeout_s):
                return Grade("worker_died")
            result = await worker.grade(expected, text, self.timeout_s)
            return result
        finally:
            self._busy.discard(worker)
            await self._release(worker, healthy=result is not None and result.status == "ok")

    async def _take_worker(self) -> _Worker | None:
        """An idle worker that is still alive (dead ones are reaped), else a new one; None once the
        pool is closed (a close may come while a dead one is reaped)."""
        while self._idle:
            worker = self._idle.pop()
            if worker.process.is_alive():
                return worker
            await worker.stop()
        return None if self._closed else _Worker(self._grade, self._warm_up)

    async def _release(self, worker: _Worker, healthy: bool) -> None:
        if healthy and not self._closed:
            self._idle.append(worker)
        else:
            await worker.stop()

    @property
    def live_workers(self) -> int:
        return len(self._idle) + len(self._busy)

    async def aclose(self) -> None:
        """Stop the idle workers; kill the busy ones, whose grades see their pipes end and stop them
        (closing a pipe a grade waits on would leave that wait to its deadline)."""
        self._closed = True
        idle, self._idle = self._idle, []
        for worker in self._busy:
            worker.process.kill()
        for worker in idle:
            with contextlib.suppress(OSError):
                worker.conn.send(None)
            await worker.stop()
