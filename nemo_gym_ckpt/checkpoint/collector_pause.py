"""No automatic garbage collection while a checkpoint is open in this process: ``CollectorPause``.

A server with thousands of rollouts in flight holds about a million objects that the cyclic garbage
collector tracks (episode states, sessions, ledgers). A full collection walks all of them: about a
second of a held event loop at 4,096 in flight, every few seconds, and it almost never finds garbage
(reference counting frees nearly everything). Inside a checkpoint, the commit's export allocates a
record per episode, which is exactly what starts such a collection; the pause then waits for it.

So each participant holds the collector off from the moment a checkpoint opens (its first prepare)
until it closes (resume, abort, lease expiry), and the process's collector runs again after the
pause, where it costs a rollout some latency and the checkpoint nothing. Reference counting goes on,
so only cyclic garbage waits. Bounds:

- the collector comes back after ``max_off_s`` (``MAX_OFF_S``) at the latest, even with the
  checkpoint still open (a controller that died, a lease of minutes): one watchdog thread per
  process, started by the first hold, looks every ``max_off_s / 4`` (at most every second) and needs
  no event loop. Holding and releasing only flip flags under a lock: no thread is started or woken
  inside a checkpoint (a thread woken there takes the interpreter lock from the server's event loop
  at the next switch interval, in the middle of a prepare or a resume);
- a process whose collector was already off (the application turned it off) is left as it was;
- several holders in one process (tests mount several servers in one) share it: it is back on once
  the last one lets go.

``mount_checkpointing`` hands the process's ``PROCESS_COLLECTOR`` to each participant when the
checkpoint block's ``pause_garbage_collection`` is true (the default); with checkpointing off nothing
here runs.
"""

from __future__ import annotations

import gc
import threading
import time
from typing import Any

__all__ = ["MAX_OFF_S", "PROCESS_COLLECTOR", "CollectorPause"]

MAX_OFF_S = 60.0


class CollectorPause:
    """Automatic collection off while any holder holds it (at most ``max_off_s`` in one stretch)."""

    def __init__(self, max_off_s: float = MAX_OFF_S) -> None:
        if max_off_s <= 0:
            raise ValueError("max_off_s must be > 0")
        self.max_off_s = max_off_s
        self.counts = {"pauses": 0, "timed_out": 0}
        self._holders: set[int] = set()
        self._lock = threading.Lock()
        self._since: float | None = None  # when the collector went off (None: not paused by us)
        self._turned_off = False  # this pause turned the collector off (it was on)
        self._watchdog: threading.Thread | None = None

    @property
    def holding(self) -> bool:
        return bool(self._holders)

    def hold(self, holder: object) -> None:
        """Keep the collector off until ``release(holder)`` (or the time bound)."""
        with self._lock:
            if self._holders:
                self._holders.add(id(holder))
                return
            self._holders.add(id(holder))
            self.counts["pauses"] += 1
            self._turned_off = gc.isenabled()
            gc.disable()
            self._since = time.monotonic()
            if self._watchdog is None:
                self._watchdog = threading.Thread(target=self._watch, name="collector-pause-bound", daemon=True)
                self._watchdog.start()

    def release(self, holder: object) -> None:
        """``holder`` lets go; the collector is back on once no holder is left. Idempotent."""
        with self._lock:
            self._holders.discard(id(holder))
            if not self._holders:
                self._end()

    def status(self) -> dict[str, Any]:
        return {"collector_paused": self.holding, **self.counts}

    def _watch(self) -> None:
        every_s = min(1.0, self.max_off_s / 4)
        while True:
            time.sleep(every_s)
            with self._lock:
                if self._since is not None and time.monotonic() - self._since >= self.max_off_s:
                    self.counts["timed_out"] += 1
                    self._holders.clear()
                    self._end()

    def _end(self) -> None:
        self._since = None
        if self._turned_off:
            gc.enable()
            self._turned_off = False


PROCESS_COLLECTOR = CollectorPause()
