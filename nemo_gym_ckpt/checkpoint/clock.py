"""Time for leases and deadlines, injectable: the wall clock here, a fake one in ``nemo_gym_ckpt.testing.clock``.

Deadlines on the wire are absolute Unix seconds, so a clock is ``now() -> float`` (Unix seconds)
plus ``sleep_until(ts)``. ``wait_until(clock, awaitable, ts)`` races an awaitable against the clock
and is how every bounded wait in the checkpoint code is written.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from typing import Any, Protocol, TypeVar

__all__ = ["SYSTEM_CLOCK", "Clock", "SystemClock", "wait_until"]

T = TypeVar("T")


class Clock(Protocol):
    def now(self) -> float: ...

    async def sleep_until(self, ts: float) -> None: ...


class SystemClock:
    """Wall-clock Unix time; ``sleep_until`` re-checks after waking, so clock steps are harmless."""

    def now(self) -> float:
        return time.time()

    async def sleep_until(self, ts: float) -> None:
        while (remaining := ts - time.time()) > 0:
            await asyncio.sleep(remaining)


SYSTEM_CLOCK = SystemClock()


async def wait_until(clock: Clock, awaitable: Awaitable[T], ts: float) -> tuple[bool, T | None]:
    """Await ``awaitable`` until ``clock`` reaches ``ts``: ``(True, result)`` or ``(False, None)``.

    On time-out the awaitable is cancelled (wrap it in ``asyncio.shield`` to keep it running); an
    awaitable that someone else cancels is not done either. On the system clock the awaitable runs
    in the caller's own task under a timeout (``_wait_on_system_clock``); on another clock it races
    that clock's sleep.
    """
    if type(clock) is SystemClock:
        return await _wait_on_system_clock(awaitable, ts)
    work = asyncio.ensure_future(awaitable)
    timer = asyncio.ensure_future(clock.sleep_until(ts))
    try:
        await asyncio.wait({work, timer}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        timer.cancel()
        if not work.done():
            work.cancel()
    if work.done() and not work.cancelled():
        return True, work.result()
    return False, None


async def _wait_on_system_clock(awaitable: Awaitable[T], ts: float) -> tuple[bool, T | None]:
    """``wait_until`` on the wall clock, with no task of its own: the awaitable is awaited in the
    caller's task, under an ``asyncio.timeout`` that a wall-clock check (``_WallDeadline``) expires.

    Each task, and each future that ``asyncio.wait`` watches, costs a turn of the event loop before
    its result reaches the caller; on a busy server a turn is every callback that was ready when it
    began (hundreds of milliseconds with thousands of episodes in flight), so a prepare whose
    readiness was known at once still waited three turns. Awaited in place, work that needs no
    other turn (a readiness from counters, an event already set) answers in the turn it was asked.
    """
    try:
        async with asyncio.timeout(None) as window:
            deadline = _WallDeadline(window, ts)
            try:
                return True, await awaitable
            except asyncio.CancelledError:
                if _cancelled_by_someone_else(awaitable, window):
                    return False, None
                raise
            finally:
                deadline.disarm()
    except TimeoutError:
        if window.expired():
            return False, None
        raise


def _cancelled_by_someone_else(awaitable: Awaitable[Any], window: asyncio.Timeout) -> bool:
    """Whether a ``CancelledError`` came from the awaited future being cancelled elsewhere, not from
    this task being cancelled (by its caller or by the deadline)."""
    task = asyncio.current_task()
    return (isinstance(awaitable, asyncio.Future) and awaitable.cancelled() and not window.expired()
            and task is not None and not task.cancelling())


class _WallDeadline:
    """Expires ``window`` once the wall clock reaches ``ts``: a timer on the loop's own clock,
    re-checked against the wall clock when it fires (like ``SystemClock.sleep_until``)."""

    def __init__(self, window: asyncio.Timeout, ts: float) -> None:
        self._window = window
        self._ts = ts
        self._loop = asyncio.get_running_loop()
        self._timer: asyncio.TimerHandle | None = None
        self._check()

    def _check(self) -> None:
        remaining = self._ts - time.time()
        if remaining > 0:
            self._timer = self._loop.call_later(remaining, self._check)
        else:
            self._window.reschedule(self._loop.time())

    def disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
