"""Sending a call again after an up-front refusal (429), within the call's one deadline.

A server that holds all the work it may (our inference worker at its ``max_waiting_requests``, an
upstream server at its rate limit) refuses a request with 429 before anything of it has started:
``Overloaded``, whose ``retry_after_s`` is the reply's ``Retry-After`` bounded to 1-60 s (1 s when
missing or unreadable, ``errors.retry_after_seconds``). ``admitted`` sends the very same request
again after that wait, as long as the wait ends before the call's deadline; a refusal the deadline
leaves no room to wait for is raised, and the policy model answers its own caller with that 429
``capacity_exceeded`` and its ``Retry-After``. Only a request whose reply has not started is ever
sent again: nothing has reached the caller yet.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

from nemo_gym_ckpt.errors import Overloaded

__all__ = ["admitted"]

logger = logging.getLogger(__name__)

T = TypeVar("T")


async def admitted(send: Callable[[float], Awaitable[T]], deadline: float, server: str) -> T:
    """``send(seconds left)``, sent again after the ``Retry-After`` of each up-front refusal
    (``Overloaded``) while that wait ends before ``deadline`` (the event loop's clock); a refusal it
    does not is raised. ``server`` names the refusing server in the log."""
    loop = asyncio.get_running_loop()
    while True:
        try:
            return await send(deadline - loop.time())
        except Overloaded as refused:
            if loop.time() + refused.retry_after_s >= deadline:
                raise
            logger.info("%s refused a call up front (%s); sending it again in %g s", server, refused.detail,
                        refused.retry_after_s)
            await asyncio.sleep(refused.retry_after_s)
