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
"""

from __future__ import annotations

from nemo_gym_ckpt.slots import Slot, Slots

__all__ = ["DEFAULT_MAX_ROLLOUTS", "RolloutCapacity"]

DEFAULT_MAX_ROLLOUTS = 4096


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
