"""When the collector checkpoints: a timer, SIGUSR1 (checkpoint and go on), SIGTERM (checkpoint, stop).

``Triggers`` is a small inbox the collector's control loop reads with ``next(tick_s)``. It answers
the most urgent request first: ``STOP`` (the collection ended: ``close``), then ``SIGTERM``, then
``SIGUSR1`` or another requested reason, then ``TIMER`` when ``every_s`` passed since the last
checkpoint started, and ``None`` after ``tick_s`` with nothing to do (a moment for housekeeping).
``install_signals`` routes the two signals to ``request`` while a loop runs; requests arriving
while a checkpoint is under way are kept for the next turn.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from types import FrameType

__all__ = ["SIGNALS", "SIGTERM", "SIGUSR1", "STOP", "TIMER", "Triggers", "hold_signals", "install_signals"]

STOP = "stop"
SIGTERM = "SIGTERM"
SIGUSR1 = "SIGUSR1"
TIMER = "timer"
SIGNALS = (signal.SIGUSR1, signal.SIGTERM)
_PRIORITY = (STOP, SIGTERM, SIGUSR1)


class Triggers:
    """Checkpoint requests and the periodic timer, read one at a time by the control loop."""

    def __init__(self, every_s: float | None = None, *, clock: Callable[[], float] = time.monotonic) -> None:
        if every_s is not None and every_s <= 0:
            raise ValueError(f"every_s must be > 0, got {every_s}")
        self.every_s = every_s
        self.clock = clock
        self._pending: list[str] = []
        self._changed = asyncio.Event()
        self._last = clock()

    def request(self, reason: str) -> None:
        """Ask for ``reason`` (a signal name, ``STOP``, or any label); safe from a signal handler."""
        if reason not in self._pending:
            self._pending.append(reason)
        self._changed.set()

    def close(self) -> None:
        """The collection ended: ``next`` answers ``STOP`` from now on."""
        self.request(STOP)

    @property
    def closed(self) -> bool:
        return STOP in self._pending

    def started(self) -> None:
        """A checkpoint starts now: the timer counts from here."""
        self._last = self.clock()

    def _take(self) -> str | None:
        for reason in (*_PRIORITY, *self._pending):
            if reason in self._pending:
                if reason != STOP:
                    self._pending.remove(reason)
                return reason
        if self.every_s is not None and self.clock() - self._last >= self.every_s:
            return TIMER
        return None

    def _wait_s(self, tick_s: float) -> float:
        if self.every_s is None:
            return tick_s
        return max(0.0, min(tick_s, self._last + self.every_s - self.clock()))

    async def next(self, tick_s: float) -> str | None:
        """The next request; ``None`` when ``tick_s`` passed with none."""
        reason = self._take()
        if reason is not None:
            return reason
        self._changed.clear()
        with suppress(TimeoutError):
            await asyncio.wait_for(self._changed.wait(), timeout=self._wait_s(tick_s))
        return self._take()


@contextmanager
def hold_signals(triggers: Triggers) -> Iterator[None]:
    """While inside (no loop needed), SIGUSR1 is kept as a request instead of ending the process.

    For the time before the collector's loop runs (the mesh starting): SIGTERM stays whoever's it is
    (the launcher stops starting on it).
    """

    def handler(signum: int, frame: FrameType | None) -> None:
        triggers.request(SIGUSR1)

    previous = signal.signal(signal.SIGUSR1, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGUSR1, previous)


@contextmanager
def install_signals(triggers: Triggers) -> Iterator[None]:
    """While inside (in a running loop), SIGUSR1 and SIGTERM become requests of ``triggers``."""
    loop = asyncio.get_running_loop()
    previous = {signum: signal.getsignal(signum) for signum in SIGNALS}
    for signum in SIGNALS:
        loop.add_signal_handler(signum, triggers.request, signal.Signals(signum).name)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            loop.remove_signal_handler(signum)
            signal.signal(signum, handler)
