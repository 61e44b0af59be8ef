"""The worker's generation hold: no decode steps while a checkpoint of the mesh is open.

On a CPU mesh the worker's engine shares the few cores with the participants that write a
checkpoint; while the pause lasts its steps only slow the commits down (replies are held until the
resume anyway). The policy model therefore asks the worker to hold generation once it is ready
(every delivered stream drained) and to release it at the resume (``policy_model.generation_hold``).

A hold names its checkpoint and lasts at most ``seconds`` (``hold_wire``: at most ``MAX_HOLD_S``): a policy model
that dies, or a release that is lost, never leaves the worker stopped for longer. A release for the
checkpoint holding ends it; the ids released are remembered (``REMEMBERED``), so a hold that
arrives after the release of its checkpoint (the two crossed) holds nothing. A hold for another
checkpoint than the one holding takes its place: the earlier one's release was lost. The engine
pauses in vLLM's ``keep`` mode: requests stay admitted, frozen at a token boundary, and go on after.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from model_servers.inference_worker.engine import Engine
from nemo_gym_ckpt.checkpoint.hold_wire import HoldRequest, ReleaseRequest
from nemo_gym_ckpt.errors import InvalidRequest, Unavailable

__all__ = ["REMEMBERED", "GenerationHold"]

REMEMBERED = 64
logger = logging.getLogger(__name__)


class GenerationHold:
    """At most one hold at a time on the engine ``engine_of()`` returns."""

    def __init__(self, engine_of: Callable[[], Engine]) -> None:
        self._engine_of = engine_of
        self._holder: str | None = None
        self._since = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._released: OrderedDict[str, None] = OrderedDict()
        self.counts = {"holds": 0, "releases": 0, "expired": 0, "late_holds": 0}
        self.held_ms = 0.0

    @property
    def holder(self) -> str | None:
        return self._holder

    def hold(self, request: HoldRequest) -> dict[str, Any]:
        """Stop the engine's steps for ``request.checkpoint_id`` for at most ``request.seconds``."""
        engine = self._engine_of()
        if not engine.pausable:
            raise InvalidRequest(f"this worker's engine ({type(engine).__name__}) cannot hold generation")
        if request.checkpoint_id in self._released:
            self.counts["late_holds"] += 1
            return self.status()
        if self._holder is None:
            self._since = time.perf_counter()
            self.counts["holds"] += 1
        self._holder = request.checkpoint_id
        self._restart_timer(request.checkpoint_id, request.seconds)
        engine.pause_generation()
        return self.status()

    def release(self, request: ReleaseRequest) -> dict[str, Any]:
        """End the hold of ``request.checkpoint_id`` (if it holds); later holds for it hold nothing."""
        self._released[request.checkpoint_id] = None
        self._released.move_to_end(request.checkpoint_id)
        while len(self._released) > REMEMBERED:
            self._released.popitem(last=False)
        if self._holder == request.checkpoint_id:
            self.counts["releases"] += 1
            self._end()
        return self.status()

    def close(self) -> None:
        """The app stops: whatever holds ends (the engine is closed next)."""
        if self._holder is not None:
            self._end()

    def status(self) -> dict[str, Any]:
        return {"held_by": self._holder, **self.counts, "held_ms": round(self.held_ms, 3)}

    def _restart_timer(self, checkpoint_id: str, seconds: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = asyncio.get_running_loop().call_later(seconds, self._expire, checkpoint_id)

    def _expire(self, checkpoint_id: str) -> None:
        if self._holder == checkpoint_id:
            logger.warning("generation hold for checkpoint %s expired without a release", checkpoint_id)
            self.counts["expired"] += 1
            self._end()

    def _end(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._holder = None
        self.held_ms += 1000 * (time.perf_counter() - self._since)
        with contextlib.suppress(Unavailable):  # an engine already gone has nothing to resume
            self._engine_of().resume_generation()
