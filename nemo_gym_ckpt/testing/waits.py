"""Waiting for a condition in a test: poll with a deadline, never a bare sleep.

``until`` (async) and ``until_sync`` call ``condition`` until it answers something truthy and return
that value; past ``timeout_s`` they raise ``AssertionError`` naming ``what``. An async condition
(a coroutine function, or a function returning an awaitable) is awaited each round.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable
from typing import Any

__all__ = ["until", "until_sync"]


async def until(
    condition: Callable[[], Any], what: str = "the condition", *, timeout_s: float = 10.0, interval_s: float = 0.001
) -> Any:
    """Poll ``condition`` on the running loop until it holds; its value, or ``AssertionError``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"not within {timeout_s:g} s: {what}")
        await asyncio.sleep(interval_s)


def until_sync(
    condition: Callable[[], Any], what: str = "the condition", *, timeout_s: float = 10.0, interval_s: float = 0.01
) -> Any:
    """``until`` for a thread without an event loop (a test driving real processes)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"not within {timeout_s:g} s: {what}")
        time.sleep(interval_s)
