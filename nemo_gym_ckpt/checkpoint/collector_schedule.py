"""Full garbage collections on a schedule instead of Python's own: ``FullCollections``.

CPython starts a full collection (every tracked object walked) whenever the objects that survived
into the oldest generation since the last one reach a quarter of it. A server with 4,096 rollouts in
flight tracks about a million objects (the awaiting call chains of its open requests, episode
states, sessions), and its rollouts keep promoting new ones: a full collection of 0.3-1.3 s every
few seconds, which finds almost nothing (0-230 objects in the scale bench: reference counting frees
nearly everything). ``CollectorPause`` keeps them out of an open checkpoint, but one that started
just before a prepare arrived still holds that prepare (a 1.65 s pause at 4,096 in flight, of which
the environment's collection was 1.3 s), and each one holds every rollout of the process.

So while a checkpointing server runs, its process makes no automatic full collection (the young
generations are collected as before: cycles that die young are freed as soon as ever); one thread
runs a full collection every ``interval_s`` instead, put off while a checkpoint is open (it looks
again every ``RETRY_S``). Only cyclic garbage that survived into the oldest generation waits, for at
most the interval plus the longest pause; everything reference counting frees is freed at once.

Process-wide (``PROCESS_FULL_COLLECTIONS``): each server app that mounts checkpointing with an
interval ``start``s it when the app starts and ``stop``s it when the app shuts down; the thresholds
are changed by the first start and given back by the last stop. A process whose collector the
application turned off is left alone (the thread runs no collection while ``gc.isenabled()`` is
false outside a pause, because then nobody asked for collections).
"""

from __future__ import annotations

import gc
import threading
import time
from typing import Any

from nemo_gym_ckpt.checkpoint.collector_pause import PROCESS_COLLECTOR, CollectorPause

__all__ = ["NEVER", "PROCESS_FULL_COLLECTIONS", "RETRY_S", "FullCollections"]

NEVER = 2**31 - 1
"""The oldest generation's threshold while scheduled: no automatic full collection."""
RETRY_S = 1.0
"""How soon a full collection put off by an open checkpoint is tried again."""


class FullCollections:
    """Full collections every ``interval_s`` seconds (not while ``pause`` holds the collector)."""

    def __init__(self, pause: CollectorPause = PROCESS_COLLECTOR) -> None:
        self.pause = pause
        self.counts = {"full_collections": 0, "put_off": 0}
        self.last_ms: float | None = None
        self._users = 0
        self._interval_s = 0.0
        self._saved: tuple[int, int, int] | None = None
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    @property
    def running(self) -> bool:
        return self._thread is not None

    def start(self, interval_s: float) -> None:
        """One more user; the first takes the oldest generation off Python's schedule. With several
        users the shortest interval asked for applies."""
        if interval_s <= 0:
            raise ValueError("interval_s must be > 0")
        with self._lock:
            self._users += 1
            self._interval_s = interval_s if self._users == 1 else min(self._interval_s, interval_s)
            if self._thread is not None:
                return
            self._saved = gc.get_threshold()
            young, middle, _ = self._saved
            gc.set_threshold(young, middle, NEVER)
            self._stopped = threading.Event()
            self._thread = threading.Thread(target=self._run, args=(self._stopped,), name="full-collections",
                                            daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """One user fewer; the last gives Python its thresholds back and ends the thread."""
        with self._lock:
            if self._users == 0:
                return
            self._users -= 1
            if self._users or self._thread is None:
                return
            thread, self._thread = self._thread, None
            if self._saved is not None:
                gc.set_threshold(*self._saved)
                self._saved = None
            self._stopped.set()
        thread.join(timeout=5.0)

    def status(self) -> dict[str, Any]:
        return {"scheduled": self.running, "interval_s": self._interval_s, **self.counts,
                "last_full_collection_ms": self.last_ms}

    def collect_now(self) -> bool:
        """Run one full collection unless a checkpoint holds the collector (or the application
        turned it off): ``True`` if it ran."""
        if self.pause.holding or not gc.isenabled():
            self.counts["put_off"] += 1
            return False
        began = time.perf_counter()
        gc.collect(2)
        self.last_ms = round(1000 * (time.perf_counter() - began), 1)
        self.counts["full_collections"] += 1
        return True

    def _run(self, stopped: threading.Event) -> None:
        wait_s = self._interval_s
        while not stopped.wait(wait_s):
            wait_s = self._interval_s if self.collect_now() else RETRY_S


PROCESS_FULL_COLLECTIONS = FullCollections()
