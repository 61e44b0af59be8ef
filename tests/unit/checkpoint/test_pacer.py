"""The pace of requests after a resume: at most ``per_turn`` woken requests go on per turn of the event
loop, in the order they came, none lost (a cancelled one skipped), and a participant's parked requests
go on at that pace once its checkpoint closes."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from nemo_gym_ckpt.checkpoint.models import ControlRequest
from nemo_gym_ckpt.checkpoint.pacer import Pacer
from nemo_gym_ckpt.checkpoint.participant import Participant
from nemo_gym_ckpt.checkpoint.store import CheckpointStore
from nemo_gym_ckpt.identity import RolloutIdentity
from nemo_gym_ckpt.testing.clock import FakeClock
from nemo_gym_ckpt.testing.minimal import SessionsAdapter

from .conftest import GRACE_S

pytestmark = pytest.mark.unit

WAIT_S = 10.0


class Turns:
    """Counts the turns of the running event loop (a callback that schedules itself again)."""

    def __init__(self) -> None:
        self.now = 0
        self._stopped = False
        asyncio.get_running_loop().call_soon(self._tick)

    def _tick(self) -> None:
        if not self._stopped:
            self.now += 1
            asyncio.get_running_loop().call_soon(self._tick)

    def stop(self) -> None:
        self._stopped = True


def per_turn(records: list[tuple[int, int]]) -> dict[int, int]:
    counts: dict[int, int] = {}
    for turn, _ in records:
        counts[turn] = counts.get(turn, 0) + 1
    return counts


async def test_at_most_per_turn_go_on_in_one_turn_in_their_order() -> None:
    pacer, went = Pacer(per_turn=10), []
    turns = Turns()

    async def one(n: int) -> None:
        await pacer.turn()
        went.append((turns.now, n))

    await asyncio.wait_for(asyncio.gather(*(one(n) for n in range(95))), WAIT_S)
    turns.stop()
    assert [n for _, n in went] == list(range(95))
    counts = per_turn(went)
    assert max(counts.values()) <= 10 and len(counts) >= 10


async def test_a_caller_cancelled_while_it_waits_is_skipped() -> None:
    pacer = Pacer(per_turn=1)
    first = asyncio.ensure_future(pacer.turn())
    second = asyncio.ensure_future(pacer.turn())
    third = asyncio.ensure_future(pacer.turn())
    await asyncio.sleep(0)
    second.cancel()
    await asyncio.wait_for(asyncio.gather(first, third), WAIT_S)
    assert second.cancelled()
    with pytest.raises(ValueError):
        Pacer(per_turn=0)


async def test_parked_requests_go_on_at_the_pacers_pace_after_a_resume(root: Path, clock: FakeClock) -> None:
    adapter = SessionsAdapter()
    gated = Participant(kind="agent", instance="a1", adapter=adapter, store=CheckpointStore(root),
                        lease_grace_s=GRACE_S, clock=clock)
    adapter.participant = gated
    gated.pacer = Pacer(per_turn=8)
    await gated.prepare(ControlRequest(checkpoint_id="c1", deadline_ts=clock.now() + 10))
    went: list[tuple[int, int]] = []
    turns = Turns()

    async def parked(n: int) -> None:
        await gated.admit(RolloutIdentity(f"w{n}"))
        went.append((turns.now, n))

    waiting = [asyncio.create_task(parked(n)) for n in range(60)]
    while gated.status()["waiting_requests"] < 60:
        await asyncio.sleep(0)
    await gated.resume(ControlRequest(checkpoint_id="c1", deadline_ts=clock.now() + 10))
    await asyncio.wait_for(asyncio.gather(*waiting), WAIT_S)
    turns.stop()
    assert sorted(n for _, n in went) == list(range(60))
    assert max(per_turn(went).values()) <= 8
