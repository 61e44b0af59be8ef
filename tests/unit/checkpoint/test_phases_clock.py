"""The transition table, the clocks and bounded waits, the lease, and the public surface."""

from __future__ import annotations

import asyncio
import importlib
import pkgutil
import time

import pytest

import nemo_gym_ckpt.checkpoint as package
from nemo_gym_ckpt.checkpoint.admission import Signal
from nemo_gym_ckpt.checkpoint.clock import SYSTEM_CLOCK, wait_until
from nemo_gym_ckpt.checkpoint.lease import Lease
from nemo_gym_ckpt.checkpoint.phases import OPEN_PHASES, TRANSITIONS, Op, Phase, advance, allowed_from
from nemo_gym_ckpt.errors import InvalidPhase
from nemo_gym_ckpt.testing.clock import FakeClock
from tests.support.loop_turns import TurnCounter

pytestmark = pytest.mark.unit

EXPECTED = {
    (Op.PREPARE, Phase.IDLE): Phase.PREPARING,
    (Op.PREPARE, Phase.PREPARING): Phase.PREPARING,
    (Op.READY, Phase.PREPARING): Phase.PREPARED,
    (Op.COMMIT, Phase.PREPARED): Phase.COMMITTED,
    (Op.RESTORE, Phase.IDLE): Phase.RESTORED,
    **{
        (Op.RESUME, p): Phase.IDLE for p in (Phase.PREPARING, Phase.PREPARED, Phase.COMMITTED, Phase.RESTORED)
    },
    **{(Op.RENEW, p): p for p in (Phase.PREPARING, Phase.PREPARED, Phase.COMMITTED, Phase.RESTORED)},
    **{(op, p): p for op in (Op.RETIRE, Op.FORGET) for p in (Phase.IDLE, Phase.RESTORED)},
}


@pytest.mark.parametrize("op", list(Op))
@pytest.mark.parametrize("phase", list(Phase))
def test_the_transition_table_is_the_protocol(op: Op, phase: Phase) -> None:
    assert TRANSITIONS == EXPECTED
    if (op, phase) in EXPECTED:
        assert advance(phase, op) is EXPECTED[(op, phase)]
        return
    with pytest.raises(InvalidPhase) as caught:
        advance(phase, op)
    assert caught.value.detail == f"{op} expected phase {' or '.join(allowed_from(op))}, got {phase}"


def test_open_phases() -> None:
    assert Phase.IDLE not in OPEN_PHASES and len(OPEN_PHASES) == 4


async def test_fake_clock_wakes_sleepers_in_time_order() -> None:
    clock = FakeClock(start=100.0)
    woke: list[float] = []

    async def sleeper(ts: float) -> None:
        await clock.sleep_until(ts)
        woke.append(ts)

    tasks = [asyncio.create_task(sleeper(ts)) for ts in (105.0, 101.0, 103.0)]
    await asyncio.sleep(0)
    assert clock.sleepers == 3
    clock.advance(3.5)
    await asyncio.wait_for(asyncio.gather(tasks[1], tasks[2]), 5)
    assert woke == [101.0, 103.0] and not tasks[0].done()
    clock.advance(10)
    await asyncio.wait_for(tasks[0], 5)
    await clock.sleep_until(50.0)  # the past returns at once


async def test_wait_until_races_the_clock_and_cancels_the_loser() -> None:
    clock = FakeClock(start=0.0)
    event = asyncio.Event()
    waiting = asyncio.ensure_future(wait_until(clock, event.wait(), 10.0))
    await asyncio.sleep(0)
    clock.advance(10)
    assert await asyncio.wait_for(waiting, 5) == (False, None)
    event.set()
    assert await wait_until(clock, event.wait(), 20.0) == (True, True)

    async def boom() -> None:
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        await wait_until(clock, boom(), 20.0)


async def test_wait_until_on_the_system_clock_gives_the_same_answers() -> None:
    event = asyncio.Event()
    work = asyncio.ensure_future(event.wait())
    assert await wait_until(SYSTEM_CLOCK, work, SYSTEM_CLOCK.now() + 0.02) == (False, None)
    await asyncio.sleep(0)  # a cancelled task ends at its next step
    assert work.cancelled(), "the loser is cancelled"
    event.set()
    assert await wait_until(SYSTEM_CLOCK, event.wait(), SYSTEM_CLOCK.now() - 1) == (True, True), (
        "work done at its first step wins even against a deadline already past")

    job = asyncio.ensure_future(asyncio.sleep(10))
    kept = asyncio.ensure_future(wait_until(SYSTEM_CLOCK, asyncio.shield(job), SYSTEM_CLOCK.now() + 5))
    await asyncio.sleep(0)
    job.cancel()  # someone else cancels the shielded work: not done, and no exception escapes
    assert await asyncio.wait_for(kept, 5) == (False, None)

    async def boom() -> None:
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        await wait_until(SYSTEM_CLOCK, boom(), SYSTEM_CLOCK.now() + 5)


async def test_on_the_system_clock_work_done_at_once_answers_in_the_turn_it_was_asked() -> None:
    async def counted() -> int:
        return 7

    event = asyncio.Event()
    event.set()
    counter = TurnCounter()
    answers = [await wait_until(SYSTEM_CLOCK, counted(), SYSTEM_CLOCK.now() + 5),
               await wait_until(SYSTEM_CLOCK, event.wait(), SYSTEM_CLOCK.now() + 5)]
    assert (counter.stop(), answers) == (0, [(True, 7), (True, True)]), (
        "no task and no asyncio.wait between the caller and work that needs no other turn")


async def test_on_the_system_clock_the_deadline_is_the_wall_clocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The loop's timer fires on its own clock; a wall clock stepped back meanwhile is waited for."""
    from nemo_gym_ckpt.checkpoint import clock as clock_module

    step = {"back_s": 0.0}
    real_time = time.time
    monkeypatch.setattr(clock_module.time, "time", lambda: real_time() - step["back_s"])
    ts = clock_module.time.time() + 0.05
    loop = asyncio.get_running_loop()
    loop.call_later(0.02, step.update, {"back_s": 0.1})
    assert await wait_until(SYSTEM_CLOCK, asyncio.Event().wait(), ts) == (False, None)
    assert clock_module.time.time() >= ts, "the wait ended before the wall clock reached its deadline"


async def test_a_signal_wakes_whoever_took_its_event_and_only_them() -> None:
    signal = Signal()
    signal.notify()  # nobody waits: nothing to wake
    taken = signal.current
    assert signal.current is taken, "the same event until the next notify"
    waiter = asyncio.ensure_future(taken.wait())
    signal.notify()
    assert await asyncio.wait_for(waiter, 5) is True
    assert signal.current is not taken and not signal.current.is_set()


async def test_the_system_clock_sleeps_for_real() -> None:
    start = SYSTEM_CLOCK.now()
    await SYSTEM_CLOCK.sleep_until(start + 0.01)
    assert SYSTEM_CLOCK.now() >= start + 0.01


async def test_the_lease_follows_renewals_and_fires_once() -> None:
    clock = FakeClock(start=0.0)
    fired: list[float] = []
    lease = Lease.start(clock, 10.0, deadline_ts=5.0)
    watcher = asyncio.create_task(lease.watch(lambda: fired.append(clock.now())))
    await asyncio.sleep(0)
    assert lease.expires_at == 15.0 and not lease.expired
    assert lease.renew(20.0) == 30.0
    clock.advance(15)
    await asyncio.sleep(0)
    assert fired == [] and not watcher.done()
    clock.advance(15)
    await asyncio.wait_for(watcher, 5)
    assert fired == [30.0] and lease.expired


def test_every_module_declares_its_public_surface() -> None:
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        exported = getattr(module, "__all__", None)
        assert exported is not None, f"{info.name} has no __all__"
        for name in exported:
            assert hasattr(module, name), f"{info.name}.__all__ names a missing {name}"
    for name in package.__all__:
        assert hasattr(package, name)
