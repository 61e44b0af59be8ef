"""Holding the worker's generation while a checkpoint is open (``hold_generation_in_checkpoints``).

Once the policy participant is ready inside a checkpoint (every delivered stream drained; every
reply generated from then on is held until the resume anyway), ``GenerationHolder.paused`` asks
the inference worker to take no decode steps (``POST <control url>/ng-control/v1/generation-hold``,
``{checkpoint_id, seconds}``), and ``resumed`` releases it (``.../release``). On a CPU mesh the
worker shares the cores with the participants that write the checkpoint: held, its steps no longer
slow the commits down (docs/benchmarks.md, Scale). On a GPU the engine does not compete for the
CPU, so the setting is off by default.

The hold lasts until the lease's expiry (at most ``MAX_HOLD_S``), so a policy model that dies does
not stop the worker for longer; the commit extends it to its own deadline. The messages go out in
the order the participant sends them, one at a time over the control pool (``CONTROL_TIMEOUT_S``
each), and never fail a checkpoint: a hold that fails only means the worker kept generating, and a
release that fails ends by the hold's expiry. Failures are counted in the participant's status.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

from nemo_gym_ckpt.checkpoint.clock import Clock
from nemo_gym_ckpt.checkpoint.hold_wire import HOLD_ROUTE, MAX_HOLD_S
from nemo_gym_ckpt.client import MeshClient
from nemo_gym_ckpt.errors import GymError

__all__ = ["CONTROL_TIMEOUT_S", "GenerationHolder", "HoldClient"]

CONTROL_TIMEOUT_S = 5.0
MIN_HOLD_S = 0.5
logger = logging.getLogger(__name__)


class HoldClient:
    """The worker's hold routes under ``control_url``, called with the mesh's control token."""

    def __init__(self, client: MeshClient, control_url: str, token: str) -> None:
        self._client = client
        self.url = control_url.rstrip("/") + HOLD_ROUTE
        self._headers = {"authorization": f"Bearer {token}"}

    async def hold(self, checkpoint_id: str, seconds: float) -> None:
        body = {"checkpoint_id": checkpoint_id, "seconds": seconds}
        await self._post(self.url, body)

    async def release(self, checkpoint_id: str) -> None:
        await self._post(self.url + "/release", {"checkpoint_id": checkpoint_id})

    async def _post(self, url: str, body: dict[str, Any]) -> None:
        await self._client.post_json(url, body, headers=self._headers, idempotent=True,
                                     timeout_s=CONTROL_TIMEOUT_S, rollout_prefix=False)


class GenerationHolder:
    """Sends the participant's pause window to the worker, in order, in the background."""

    def __init__(self, client: HoldClient, clock: Clock) -> None:
        self.client = client
        self.clock = clock
        self.holding: str | None = None
        self.counts = {"holds_sent": 0, "releases_sent": 0, "hold_failures": 0}
        self._last: asyncio.Task[None] | None = None

    def paused(self, checkpoint_id: str, until_ts: float) -> None:
        """Hold the worker for ``checkpoint_id`` until ``until_ts`` (participant clock) at the latest."""
        self.holding = checkpoint_id
        seconds = min(MAX_HOLD_S, max(MIN_HOLD_S, until_ts - self.clock.now()))
        self._send("hold", self.client.hold(checkpoint_id, round(seconds, 3)))

    def extend(self, checkpoint_id: str, until_ts: float) -> None:
        """The checkpoint holding runs longer (its commit's deadline): hold until then."""
        if self.holding == checkpoint_id:
            self.paused(checkpoint_id, until_ts)

    def resumed(self, checkpoint_id: str) -> None:
        if self.holding == checkpoint_id:
            self.holding = None
            self._send("release", self.client.release(checkpoint_id))

    def status(self) -> dict[str, Any]:
        return {"generation_held_by": self.holding, **self.counts}

    def _send(self, what: str, message: Coroutine[Any, Any, None]) -> None:
        self._last = asyncio.get_running_loop().create_task(self._after(self._last, what, message))

    async def _after(self, previous: asyncio.Task[None] | None, what: str, message: Coroutine[Any, Any, None]) -> None:
        if previous is not None:
            await asyncio.wait({previous})  # each ends by its own timeout
        try:
            await message
            self.counts["holds_sent" if what == "hold" else "releases_sent"] += 1
        except GymError as error:
            self.counts["hold_failures"] += 1
            logger.warning("generation %s at the worker failed (checkpoints go on): %s", what, error)
