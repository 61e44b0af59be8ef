"""Prompt hand-offs of the interpreter's lock while a commit's files are written beside the event loop.

A commit writes from a worker thread while the participant's event loop keeps running (its capture,
then whatever else it serves). Each system call of the write (``write``, ``fsync``, ``rename``, a
hash of a large chunk) lets go of the interpreter's lock; to go on, the thread must take it back, and
a loop that is running Python gives it up only when CPython's switch interval (5 ms by default)
runs out. A write of a few files is a dozen or more such calls, so beside a busy loop it waits that
long each time: measured in process with a busy thread beside a 2 MB write of 2,048 records, about
144 ms against 5 ms alone. While ``prompt_switching`` is entered the interval is
``COMMIT_SWITCH_INTERVAL_S`` (the same write: 20 ms with 256 KiB chunks, 15 ms with 1 MiB ones, at
0.5 ms). Since stop 52 it is 0.1 ms: a write of 2,048 records of 375 bytes (an environment's at
2,048 in flight), in process, beside a thread running Python, took 17.0 ms at 0.5 ms, 11.1 at
0.2, 9.0 at 0.1 and 8.2 at 0.05 (5.7 alone; medians of 7), its CPU the same. The loop loses a few
microseconds at each hand-off, for the few milliseconds a commit's write lasts.

The interval belongs to the whole process, so entries are counted: the first sets it, the last puts
back what the first found (several participants in one process may commit at once, in tests).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["COMMIT_SWITCH_INTERVAL_S", "prompt_switching"]

COMMIT_SWITCH_INTERVAL_S = 0.0001

_lock = threading.Lock()
_entered = 0
_saved = 0.0


@contextmanager
def prompt_switching() -> Iterator[None]:
    """The switch interval at ``COMMIT_SWITCH_INTERVAL_S`` (or lower, if it already was) inside."""
    global _entered, _saved
    with _lock:
        if _entered == 0:
            _saved = sys.getswitchinterval()
            sys.setswitchinterval(min(_saved, COMMIT_SWITCH_INTERVAL_S))
        _entered += 1
    try:
        yield
    finally:
        with _lock:
            _entered -= 1
            if _entered == 0:
                sys.setswitchinterval(_saved)
