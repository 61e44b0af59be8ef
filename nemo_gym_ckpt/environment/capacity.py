"""How many rollouts an environment server runs at once: the rest are refused up front.

On a mesh that serves N rollouts a second, the K-th rollout in flight waits about K/N seconds for
its turn at every shared queue (the client pools, the engine's batch). Past some K, the mesh's own
deadlines (a seed call's 120 s, a model call's 600 s) would run out for rollouts that had started,
and a rollout that fails midway is lost work. So an environment runs at most
``max_rollouts_in_flight`` ``/run`` calls at once and refuses the next one with 429
``capacity_exceeded`` and ``Retry-After``, before it reads the body: no state exists anywhere for a
refused rollout, and the caller sends the very same request again later (the collector does).
``None`` lifts the limit.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from nemo_gym_ckpt.errors import Overloaded

__all__ = ["DEFAULT_MAX_ROLLOUTS", "RolloutCapacity"]

DEFAULT_MAX_ROLLOUTS = 4096


class RolloutCapacity:
    """Counts the ``/run`` calls in flight; ``admitted`` refuses one past the limit."""

    def __init__(self, limit: int | None, retry_after_s: float = 1.0) -> None:
        if limit is not None and limit < 1:
            raise ValueError("max_rollouts_in_flight must be >= 1 (or null: no limit)")
        self.limit = limit
        self.retry_after_s = retry_after_s
        self.in_flight = 0
        self.refused = 0

    @contextmanager
    def admitted(self) -> Iterator[None]:
        if self.limit is not None and self.in_flight >= self.limit:
            self.refused += 1
            raise Overloaded(f"this environment runs {self.limit} rollouts at once (max_rollouts_in_flight); "
                             "nothing was started: send it again later", retry_after_s=self.retry_after_s)
        self.in_flight += 1
        try:
            yield
        finally:
            self.in_flight -= 1
