"""Work a participant does off the pause, in one thread at the lowest CPU priority: ``in_background``.

After its resume a participant makes the per-record index of its last commit
(``CheckpointStore.settle``). The mesh is not done resuming then: the controller resumes the kinds
one after another, and the rollouts just let go want the cores too. The index can wait (the next
commit makes it itself if it is still missing), so it runs in one thread per process whose
scheduling priority is the lowest (nice 19, for that thread only: Linux schedules each thread on its
own). Where the priority cannot be changed (another system, a sandbox that refuses), the thread keeps
the process's priority and only the work's place changes.
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

__all__ = ["LOWEST_PRIORITY", "in_background"]

LOWEST_PRIORITY = 19
"""The thread's nice value: the scheduler gives it a core when nothing else wants one."""

T = TypeVar("T")
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def in_background(work: Callable[[], T]) -> asyncio.Future[T]:
    """Run ``work`` in this process's background thread (work runs one at a time, in order)."""
    return asyncio.get_running_loop().run_in_executor(_background_pool(), work)


def _background_pool() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-background",
                                       initializer=_lowest_priority)
        return _pool


def _forget_pool() -> None:
    """In a forked child the pool's thread does not exist (and its lock may be held by a thread that
    does not either): the child makes its own when it needs one."""
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_pool)


def _lowest_priority() -> None:
    if not sys.platform.startswith("linux"):  # elsewhere the id is the whole process's
        return
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), LOWEST_PRIORITY)
    except OSError:
        return
