"""Control calls ahead of data requests on a busy server: ``ControlFirst`` (an ASGI middleware).

An event loop runs, in each turn, every callback that was ready when the turn began. When hundreds
of data requests arrive together (a burst of rollout starts: each one parses its body, renders a
chat template, tokenizes), one turn can hold seconds of CPU work, and a control call that arrives
meanwhile is not even read from its socket until the turn ends, then waits again for its handler,
and again for its reply to be written. ``ControlFirst`` keeps turns short and lets control calls
pass:

- at most ``per_turn`` data requests start their work in one turn of the loop; the others wait in
  arrival order and start in the next turns (the CPU does the same work, in shorter turns, so the
  loop looks at its sockets often);
- while a control call is being served, no data request starts (each waits at most
  ``MAX_DEFER_S``, then goes on: a long prepare never starves the data plane);
- control calls (``/ng-control/``) and ``/health`` never wait.

A data request that waits here has not entered the app: it holds no state, is not in flight for
readiness, and sees admission exactly as if it had arrived a little later. ``mount_checkpointing``
installs it, so with checkpointing off nothing of this runs.
"""

from __future__ import annotations

import asyncio
from contextlib import suppress

from starlette.types import ASGIApp, Receive, Scope, Send

from nemo_gym_ckpt.checkpoint.pacer import Pacer

__all__ = ["DATA_PER_TURN", "MAX_DEFER_S", "ControlFirst"]

DATA_PER_TURN = 8
MAX_DEFER_S = 1.0
_CONTROL_PATHS = ("/ng-control/", "/health")


class ControlFirst:
    """Serve control calls first; start at most ``per_turn`` data requests per turn of the loop."""

    def __init__(self, app: ASGIApp, per_turn: int = DATA_PER_TURN) -> None:
        self.app = app
        self.per_turn = per_turn
        self.control = 0
        self._pacer = Pacer(per_turn)
        self._quiet = asyncio.Event()
        self._quiet.set()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if scope["path"].startswith(_CONTROL_PATHS):
            await self._as_control(scope, receive, send)
            return
        await self._turn()
        await self.app(scope, receive, send)

    async def _as_control(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.control += 1
        self._quiet.clear()
        try:
            await self.app(scope, receive, send)
        finally:
            self.control -= 1
            if not self.control:
                self._quiet.set()

    async def _turn(self) -> None:
        """Wait for this request's turn: none while control calls are served, ``per_turn`` a turn."""
        if self.control:
            with suppress(TimeoutError):
                await asyncio.wait_for(self._quiet.wait(), MAX_DEFER_S)
        await self._pacer.turn()
