"""At most so many callers go on per turn of the event loop: ``Pacer``.

An event loop runs, in each turn, every callback that was ready when the turn began, and reads no
socket until the turn ends. Work that becomes ready all at once therefore makes one long turn, and a
control call that arrives meanwhile waits for all of it. Two such bursts are paced here:

- a resume wakes every request parked by the checkpoint (4,096 episodes at 4,096 in flight), and
  each runs on to its next outside call: one turn of about 180 ms, in which the next checkpoint's
  prepare waited unread (``Participant`` paces them, ``PER_TURN`` a turn);
- hundreds of data requests arriving together each parse a body and start their work
  (``ControlFirst`` paces them, a few a turn).

The CPU does the same work either way, in shorter turns, so the loop looks at its sockets often.
"""

from __future__ import annotations

import asyncio
from collections import deque

__all__ = ["PER_TURN", "Pacer"]

PER_TURN = 256
"""Requests woken by a resume that go on per turn of the loop (about 10 ms of episodes' work)."""


class Pacer:
    """At most ``per_turn`` callers of ``turn()`` go on in one turn of the event loop; the others go
    on in the following turns, first come first served. A caller cancelled while it waits is skipped."""

    def __init__(self, per_turn: int = PER_TURN) -> None:
        if per_turn < 1:
            raise ValueError("per_turn must be >= 1")
        self.per_turn = per_turn
        self._gone = 0  # callers let go in the current turn
        self._queue: deque[asyncio.Future[None]] = deque()
        self._next_turn_scheduled = False

    async def turn(self) -> None:
        if self._gone < self.per_turn and not self._queue:
            self._gone += 1
            self._schedule_next_turn()
            return
        future = asyncio.get_running_loop().create_future()
        self._queue.append(future)
        self._schedule_next_turn()
        await future

    def _schedule_next_turn(self) -> None:
        if not self._next_turn_scheduled:
            self._next_turn_scheduled = True
            asyncio.get_running_loop().call_soon(self._next_turn)

    def _next_turn(self) -> None:
        self._next_turn_scheduled = False
        self._gone = 0
        while self._queue and self._gone < self.per_turn:
            future = self._queue.popleft()
            if not future.done():
                future.set_result(None)
                self._gone += 1
        if self._queue or self._gone:
            self._schedule_next_turn()
