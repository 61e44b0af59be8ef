"""A plain-text progress bar: done of total, failures, rate, ETA and the mean reward so far.

On a terminal the line is redrawn in place (``\\r``, at most every ``redraw_s``); elsewhere (a log
file, CI) a full line is printed every ``line_every_s`` and at the end, so logs stay readable.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO

__all__ = ["Progress", "format_duration"]

WIDTH = 24


def format_duration(seconds: float) -> str:
    """``75`` -> ``1m15s``; ``3725`` -> ``1h02m``."""
    whole = max(round(seconds), 0)
    if whole < 60:
        return f"{whole}s"
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    return f"{whole // 3600}h{whole % 3600 // 60:02d}m"


class Progress:
    """Counts finished rollouts and draws the bar on ``stream``."""

    def __init__(
        self,
        total: int,
        stream: TextIO | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        interactive: bool | None = None,
        redraw_s: float = 0.1,
        line_every_s: float = 10.0,
    ) -> None:
        self.total = total
        self.stream = stream or sys.stderr
        self.clock = clock
        self.interactive = self.stream.isatty() if interactive is None else interactive
        self.interval_s = redraw_s if self.interactive else line_every_s
        self.started = clock()
        self.done = 0
        self.failed = 0
        self.reward_sum = 0.0
        self.rewarded = 0
        self._drawn_at: float | None = None
        self._drawn_done = -1

    def advance(self, *, failed: bool = False, reward: float | None = None) -> None:
        self.done += 1
        self.failed += failed
        if reward is not None:
            self.reward_sum += reward
            self.rewarded += 1
        now = self.clock()
        if self._drawn_at is None or now - self._drawn_at >= self.interval_s or self.done == self.total:
            self.draw(now)

    def rate(self, now: float | None = None) -> float:
        elapsed = (self.clock() if now is None else now) - self.started
        return self.done / elapsed if elapsed > 0 else 0.0

    def render(self, now: float | None = None) -> str:
        now = self.clock() if now is None else now
        filled = WIDTH * self.done // self.total if self.total else WIDTH
        rate = self.rate(now)
        left = self.total - self.done
        eta = format_duration(left / rate) if rate > 0 and left else ("0s" if not left else "?")
        parts = [f"[{'#' * filled}{'.' * (WIDTH - filled)}] {self.done}/{self.total}"]
        if self.failed:
            parts.append(f"{self.failed} failed")
        parts.append(f"{rate:.2f} rollouts/s  ETA {eta}")
        if self.rewarded:
            parts.append(f"mean reward {self.reward_sum / self.rewarded:.3f}")
        return "  ".join(parts)

    def draw(self, now: float | None = None) -> None:
        self._drawn_at = self.clock() if now is None else now
        self._drawn_done = self.done
        line = self.render(self._drawn_at)
        self.stream.write(f"\r{line}\x1b[K" if self.interactive else f"{line}\n")
        self.stream.flush()

    def close(self) -> None:
        """The last state (unless it is already shown), and the end of the line on a terminal."""
        if self._drawn_done != self.done:
            self.draw()
        if self.interactive:
            self.stream.write("\n")
            self.stream.flush()
