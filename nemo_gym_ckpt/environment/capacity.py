"""How many rollouts an environment server runs at once: the rest are refused up front.

On a mesh that serves N rollouts a second, the K-th rollout in flight waits about K/N seconds for
its turn at every shared queue (the client pools, the engine's batch). Past some K, the mesh's own
deadlines (a seed call's 120 s, a model call's 600 s) would run out for rollouts that had started,
and a rollout that fails midway is lost work. So an environment runs at most
``max_rollouts_in_flight`` ``/run`` calls at once and refuses the next one with 429
``capacity_exceeded`` and ``Retry-After``, before it reads the body: no state exists anywhere for a
refused rollout, and the caller sends the very same request again later (the collector does).
``None`` lifts the limit. The count and its slots are the library's (``nemo_gym_ckpt/slots.py``),
shared with the inference worker's admission; what is the environment's own is the bound's name and
the refusal's words.

The bound is kept by ``RunAdmission``, the outermost middleware of the app: a ``/run`` past the
limit is answered before anything else looks at it. On a busy server with checkpointing on,
``ControlFirst`` lets only a few data requests start per turn of the event loop; a burst of
thousands of refused calls (a driver or collector sending them again after their ``Retry-After``)
would otherwise wait there in line, turn after turn, with the rollouts that are admitted, and be
refused only when their turn came.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

from nemo_gym_ckpt.errors import GymError, Overloaded
from nemo_gym_ckpt.identity import split_rollout_path
from nemo_gym_ckpt.server import error_response
from nemo_gym_ckpt.slots import Slot, Slots

__all__ = ["DEFAULT_MAX_ROLLOUTS", "RUN_PATH", "RolloutCapacity", "RunAdmission"]

DEFAULT_MAX_ROLLOUTS = 4096
RUN_PATH = "/run"


class RolloutCapacity(Slots):
    """Counts the ``/run`` calls in flight; ``admitted`` refuses one past the limit."""

    def __init__(self, limit: int | None, retry_after_s: float = 1.0) -> None:
        super().__init__(
            limit, retry_after_s, limit_name="max_rollouts_in_flight",
            refusal=f"this environment runs {limit} rollouts at once (max_rollouts_in_flight); "
                    "nothing was started: send it again later",
        )

    @property
    def in_flight(self) -> int:
        return self.held

    def admitted(self) -> Slot:
        """A ``/run`` call's slot, for a ``with`` block: given back when the call is done."""
        return self.take()


class RunAdmission:
    """ASGI middleware: each ``POST /run`` (bare or under ``/ng-rollout/<key>``) holds a slot of
    ``capacity`` for as long as the app serves it; one past the limit is answered 429 here, before
    the app (and any middleware inside this one) sees it. Every other request passes untouched."""

    def __init__(self, app: ASGIApp, capacity: RolloutCapacity) -> None:
        self.app = app
        self.capacity = capacity

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not _is_run(scope):
            await self.app(scope, receive, send)
            return
        try:
            slot = self.capacity.admitted()
        except Overloaded as refused:
            await error_response(refused)(scope, receive, send)
            return
        with slot:
            await self.app(scope, receive, send)


def _is_run(scope: Scope) -> bool:
    if scope["type"] != "http" or scope["method"] != "POST":
        return False
    try:
        _, path = split_rollout_path(scope["path"])
    except GymError:  # a malformed prefix: the app answers it (400)
        return False
    return path == RUN_PATH
