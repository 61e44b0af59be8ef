"""Turns of the running event loop, counted: ``TurnCounter``.

A turn runs every callback that was ready when it began; on a busy server one turn can last hundreds
of milliseconds, so the turns a control call waits for are its latency there. A test counts them
with a callback that schedules itself again each turn.
"""

from __future__ import annotations

import asyncio

__all__ = ["TurnCounter"]


class TurnCounter:
    """Counts the turns of the running event loop (one callback each turn) until stopped."""

    def __init__(self) -> None:
        self.turns = 0
        self._loop = asyncio.get_running_loop()
        self._on = True
        self._loop.call_soon(self._tick)

    def _tick(self) -> None:
        if self._on:
            self.turns += 1
            self._loop.call_soon(self._tick)

    def stop(self) -> int:
        self._on = False
        return self.turns
