"""The scale bench's closed-loop driver: a rollout that fails at once never spins the driver's loop."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest

from nemo_gym_ckpt.bench import scale
from nemo_gym_ckpt.errors import Unavailable

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


LIMIT = 1_000
"""Calls after which the client stops the driver itself: a spinning driver ends there, not in a hang."""


class RefusingClient:
    """A client whose every call fails before it suspends (a refused connection, answered at once)."""

    def __init__(self) -> None:
        self.calls = 0
        self.driver: scale._Driver | None = None

    async def post_json(self, *_: Any, **__: Any) -> None:
        self.calls += 1
        if self.calls >= LIMIT and self.driver is not None:
            self.driver.stopping = True
        raise Unavailable("connection refused")


async def run_driver(slots: int, run_s: float) -> tuple[RefusingClient, scale._Driver]:
    client = RefusingClient()
    driver = client.driver = scale._Driver(client, "http://127.0.0.1:9/env", [{}], "t", slots)  # type: ignore[arg-type]
    driver.start()
    await asyncio.sleep(run_s)  # a spinning slot holds the loop until LIMIT calls stop it
    driver.stopping = True
    await driver.join(5.0)
    return client, driver


async def test_a_slot_whose_rollout_failed_waits_before_its_next_one() -> None:
    client, driver = await run_driver(4, 0.3)
    assert client.calls == driver.failed == 4, "each slot tried once and then waited"
    assert driver.failures[0] == "t-0-0: unavailable: connection refused"


async def test_failures_are_all_counted_and_the_first_ones_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(scale, "FAILED_SLOT_PAUSE_S", 0.0)
    client, driver = await run_driver(8, 0.2)
    assert scale.KEPT_FAILURES < driver.failed <= client.calls
    assert len(driver.failures) == scale.KEPT_FAILURES


async def test_the_coordinator_loop_goes_on_while_the_drivers_loop_is_held() -> None:
    """A checkpoint's control calls run on the control thread's loop: they are served while the
    driver's loop is held by one long turn (thousands of slots asking again at once), and the
    caller gets their result."""
    control = scale._ControlThread()
    steps: list[int] = []

    async def checkpoint() -> tuple[int, asyncio.AbstractEventLoop]:
        for step in range(5):
            steps.append(step)
            await asyncio.sleep(0.01)
        return threading.get_ident(), asyncio.get_running_loop()

    try:
        running = asyncio.ensure_future(control.run(checkpoint()))
        await asyncio.sleep(0)  # the call is handed over
        held_until = time.monotonic() + 2.0
        while len(steps) < 5 and time.monotonic() < held_until:  # this loop held: no await
            time.sleep(0.01)
        assert steps == [0, 1, 2, 3, 4]  # all of it ran while this loop was held
        thread, loop = await running
        assert thread != threading.get_ident() and loop is not asyncio.get_running_loop()
    finally:
        control.close()


async def test_a_cancelled_control_call_is_cancelled_on_the_control_loop() -> None:
    control = scale._ControlThread()
    cancelled = threading.Event()

    async def long_call() -> None:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    try:
        running = asyncio.ensure_future(control.run(long_call()))
        await asyncio.sleep(0.05)
        running.cancel()
        with pytest.raises(asyncio.CancelledError):
            await running
        assert await asyncio.to_thread(cancelled.wait, 5.0)
    finally:
        control.close()
