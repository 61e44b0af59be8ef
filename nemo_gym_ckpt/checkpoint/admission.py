"""Who may come in: retire marks (``stale_attempt``) and the change signal waiters sleep on.

Admission itself is derived from the phase (open exactly when idle); what is stored here is the
per-rollout retire mark (an attempt at or below it is refused until the rollout is forgotten) and
a ``Signal`` that wakes every waiter (a prepare waiting for readiness, a request waiting for
resume) whenever something they wait on may have changed. The pace at which woken requests go on
is ``pacer.Pacer``'s.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

from nemo_gym_ckpt.errors import StaleAttempt
from nemo_gym_ckpt.identity import RolloutIdentity

__all__ = ["RetireMarks", "Signal"]


class Signal:
    """A broadcast: ``current`` is an event set by the next ``notify``. Take it before you look.

    The event is made when someone takes it, so a ``notify`` nobody waits for (every request's end
    while no checkpoint is open) costs an attribute swap, not an event.
    """

    def __init__(self) -> None:
        self._event: asyncio.Event | None = None

    @property
    def current(self) -> asyncio.Event:
        if self._event is None:
            self._event = asyncio.Event()
        return self._event

    def notify(self) -> None:
        event, self._event = self._event, None
        if event is not None:
            event.set()


class RetireMarks:
    """The highest retired attempt per rollout."""

    def __init__(self) -> None:
        self._marks: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._marks)

    def admits(self, episode: RolloutIdentity) -> bool:
        """Whether ``episode`` is above its rollout's mark (or the rollout has none): ``check`` passes."""
        mark = self._marks.get(episode.rollout_id)
        return mark is None or episode.attempt > mark

    def check(self, episode: RolloutIdentity) -> None:
        if not self.admits(episode):
            raise StaleAttempt(f"attempt {episode.attempt} of rollout {episode.rollout_id!r} is retired "
                               f"(retired up to attempt {self._marks[episode.rollout_id]})")

    def retire(self, episodes: Iterable[RolloutIdentity]) -> None:
        for episode in episodes:
            self._marks[episode.rollout_id] = max(episode.attempt, self._marks.get(episode.rollout_id, -1))

    def forget(self, rollout_ids: Iterable[str]) -> None:
        for rollout_id in rollout_ids:
            self._marks.pop(rollout_id, None)
