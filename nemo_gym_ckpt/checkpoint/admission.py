"""Who may come in: retire marks (``stale_attempt``), the change signal waiters sleep on, and the
pace at which waiters go on after a resume.

Admission itself is derived from the phase (open exactly when idle); what is stored here is the
per-rollout retire mark (an attempt at or below it is refused until the rollout is forgotten), a
``Signal`` that wakes every waiter (a prepare waiting for readiness, a request waiting for resume)
whenever something they wait on may have changed, and a ``Pacer``: a resume wakes every parked
request at once (4,096 episodes at 4,096 in flight), and each runs on to its next outside call in
the same turn of the event loop, a turn of about 180 ms in which the server reads no socket, so a
control call that arrives then (the next checkpoint's prepare) waits for it. The pacer lets at most
``PER_TURN`` of them go on per turn; the others wait for the following turns, in order.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Iterable

from nemo_gym_ckpt.errors import StaleAttempt
from nemo_gym_ckpt.identity import RolloutIdentity

__all__ = ["PER_TURN", "Pacer", "RetireMarks", "Signal"]

PER_TURN = 256
"""Waiters a ``Pacer`` lets go on per turn of the event loop (about 10 ms of episodes' work)."""


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


class Pacer:
    """At most ``per_turn`` callers of ``turn()`` go on in one turn of the event loop; the others go
    on in the following turns, first come first served. A caller cancelled while it waits is skipped."""

    def __init__(self, per_turn: int = PER_TURN) -> None:
        if per_turn < 1:
            raise ValueError("per_turn must be >= 1")
        self.per_turn = per_turn
        self._gone = 0  # callers let go in the current turn
        self._queue: deque[asyncio.Future[None]] = deque()
        self._next_turn_scheduled = False

    async def turn(self) -> None:
        if self._gone < self.per_turn and not self._queue:
            self._gone += 1
            self._schedule_next_turn()
            return
        future = asyncio.get_running_loop().create_future()
        self._queue.append(future)
        self._schedule_next_turn()
        await future

    def _schedule_next_turn(self) -> None:
        if not self._next_turn_scheduled:
            self._next_turn_scheduled = True
            asyncio.get_running_loop().call_soon(self._next_turn)

    def _next_turn(self) -> None:
        self._next_turn_scheduled = False
        self._gone = 0
        while self._queue and self._gone < self.per_turn:
            future = self._queue.popleft()
            if not future.done():
                future.set_result(None)
                self._gone += 1
        if self._queue or self._gone:
            self._schedule_next_turn()


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
