"""The cyclic garbage collector of a server process's start: off while the process imports its modules
and starts its app; then one collection, what is left frozen, and the collector on again.

CPython runs a full collection each time the objects that survived into its oldest generation have
grown by a quarter since the last one. A start only grows the heap (modules, classes, an app, for the
inference worker torch and transformers with a model: some 400,000 tracked objects), so it walks
that growing heap over and over, and finds almost nothing (reference counting frees nearly
everything): about a tenth of a server process's start (0.75 of 10 CPU-seconds for the inference
worker on the default model, 0.15 of 1.3 for a calculator server). None of it runs with the
collector off. Once the app has started, one full collection frees the start's cyclic garbage (a
model's loading may leave some, tensors included) and ``gc.freeze()`` moves what is left into the
permanent generation, which no later full collection walks (Python's own, or the scheduled ones of
``checkpoint/collector_schedule.py``): they only walk what the process made since.

``pause_collector()`` comes first in a server process (``cli/serve.py`` before its imports, NeMo
Gym's bridge before ``bridge/child.py``'s); ``settled_at_startup(app)`` wraps the served ASGI app and
calls ``settle_collector()`` when the app reports its startup complete (or failed), or at the first
request of an app without a lifespan. A process whose collector was already off is left as it was.
"""

from __future__ import annotations

import gc
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # nothing but ``gc`` is imported before the pause
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["pause_collector", "paused", "settle_collector", "settled_at_startup"]

_paused = False


def paused() -> bool:
    """Whether ``pause_collector`` turned the collector off and it is not settled yet."""
    return _paused


def pause_collector() -> None:
    """Turn the collector off for the start (nothing where it is off already)."""
    global _paused
    if gc.isenabled():
        gc.disable()
        _paused = True


def settle_collector() -> None:
    """Collect the start's garbage, freeze every object left and turn the collector on, if
    ``pause_collector`` turned it off (once: later calls do nothing)."""
    global _paused
    if _paused:
        _paused = False
        gc.collect()
        gc.freeze()
        gc.enable()


def settled_at_startup(app: ASGIApp) -> ASGIApp:
    """``app``, settling the collector once its lifespan startup has ended (complete or failed), when
    its lifespan ends otherwise, or at its first request (an app without a lifespan)."""

    async def served(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "lifespan":
            settle_collector()
            await app(scope, receive, send)
            return

        async def sent(message: Message) -> None:
            if message["type"] in ("lifespan.startup.complete", "lifespan.startup.failed"):
                settle_collector()
            await send(message)

        try:
            await app(scope, receive, sent)
        finally:
            settle_collector()

    return served
