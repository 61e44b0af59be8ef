"""The scale bench's closed-loop driver: a rollout that fails at once never spins the driver's loop."""

from __future__ import annotations

import asyncio
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
