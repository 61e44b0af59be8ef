"""A clock that tests move by hand, for leases, deadlines and episode timeouts.

It keeps the ``Clock`` protocol of ``nemo_gym_ckpt.checkpoint.clock``: pass it wherever a server or
a participant takes a clock, then ``advance`` it; sleepers whose time has come wake at the next turn
of the event loop. No test has to sleep to make a lease expire.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time

__all__ = ["FakeClock"]


class FakeClock:
    """A clock that moves only when told: ``advance`` wakes every sleeper whose time has come."""

    def __init__(self, start: float | None = None) -> None:
        self._now = time.time() if start is None else start
        self._sleepers: list[tuple[float, int, asyncio.Future[None]]] = []
        self._order = itertools.count()

    def now(self) -> float:
        return self._now

    async def sleep_until(self, ts: float) -> None:
        if ts <= self._now:
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._sleepers, (ts, next(self._order), future))
        await future

    def advance(self, seconds: float) -> None:
        """Move time forward and wake the sleepers that are due (they run at the next loop turn)."""
        self._now += seconds
        while self._sleepers and self._sleepers[0][0] <= self._now:
            _, _, future = heapq.heappop(self._sleepers)
            if not future.done():
                future.set_result(None)

    @property
    def sleepers(self) -> int:
        """How many sleepers wait for a later time (cancelled ones included until they are due)."""
        return sum(1 for _, _, future in self._sleepers if not future.done())
