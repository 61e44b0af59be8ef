"""Time for leases and deadlines, injectable: the wall clock here, a fake one in ``nemo_gym_ckpt.testing.clock``.

Deadlines on the wire are absolute Unix seconds, so a clock is ``now() -> float`` (Unix seconds)
plus ``sleep_until(ts)``. ``wait_until(clock, awaitable, ts)`` races an awaitable against the clock
and is how every bounded wait in the checkpoint code is written.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from typing import Protocol, TypeVar

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

    On time-out the awaitable is cancelled (wrap it in ``asyncio.shield`` to keep it running).
    On the system clock the deadline is a timer of ``asyncio.wait`` rather than a sleeping task
    (the same result, one task fewer: episodes wait like this at every step).
    """
    work = asyncio.ensure_future(awaitable)
    if type(clock) is SystemClock:
        return await _wait_on_system_clock(work, ts)
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


async def _wait_on_system_clock(work: asyncio.Future[T], ts: float) -> tuple[bool, T | None]:
    """``wait_until`` on the wall clock: re-checked after each wake-up, like ``SystemClock.sleep_until``."""
    try:
        await asyncio.wait({work}, timeout=max(ts - time.time(), 0.0))
        while not work.done() and (remaining := ts - time.time()) > 0:
            await asyncio.wait({work}, timeout=remaining)
    finally:
        if not work.done():
            work.cancel()
    if work.done() and not work.cancelled():
        return True, work.result()
    return False, None
