"""The lease of an open checkpoint (docs/protocol.md section 4).

It expires at ``deadline_ts + lease_grace_seconds``; every control call for the open id moves the
expiry to the later of the current one and its own ``deadline_ts + lease_grace_seconds``, so a
renewal never shortens the lease (a controller that renews with an earlier deadline keeps the
later expiry, as upstream's lease does).
Expiry is derived, never stored: ``expired`` is ``expires_at <= clock.now()``. ``watch`` sleeps on
the clock until the lease runs out (following renewals) and then calls ``on_expiry`` once, so a
dead controller never leaves a participant paused.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from nemo_gym_ckpt.checkpoint.clock import Clock

__all__ = ["Lease"]


@dataclass
class Lease:
    clock: Clock
    grace_s: float
    expires_at: float
    on_moved: Callable[[], None] | None = field(default=None, compare=False)
    """Called after each renewal that moved the expiry (a multi-worker server tells its workers)."""

    @classmethod
    def start(
        cls, clock: Clock, grace_s: float, deadline_ts: float, on_moved: Callable[[], None] | None = None
    ) -> Lease:
        return cls(clock, grace_s, deadline_ts + grace_s, on_moved)

    def renew(self, deadline_ts: float) -> float:
        """Extend to this call's ``deadline_ts + grace`` unless the lease already runs longer; return
        the expiry (never earlier than before)."""
        before, self.expires_at = self.expires_at, max(self.expires_at, deadline_ts + self.grace_s)
        if self.expires_at != before and self.on_moved is not None:
            self.on_moved()
        return self.expires_at

    @property
    def expired(self) -> bool:
        return self.expires_at <= self.clock.now()

    async def watch(self, on_expiry: Callable[[], None]) -> None:
        """Sleep until the lease has run out, then call ``on_expiry`` (cancel to stop watching)."""
        while not self.expired:
            await self.clock.sleep_until(self.expires_at)
        on_expiry()
