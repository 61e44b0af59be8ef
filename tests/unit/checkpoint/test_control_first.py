"""ControlFirst: control calls start ahead of queued data requests; data requests start a few per turn."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from nemo_gym_ckpt.checkpoint.priority import MAX_DEFER_S, ControlFirst
from nemo_gym_ckpt.config import CheckpointConfig
from nemo_gym_ckpt.testing.minimal import create_minimal_server

pytestmark = pytest.mark.unit

STATUS = "/ng-control/v1/checkpoint/status"


def recording_app(order: list[str], hold: asyncio.Event | None = None) -> Any:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        order.append(scope["path"])
        if hold is not None and scope["path"] == STATUS:
            await hold.wait()
        until = time.perf_counter() + 0.0005  # a little CPU, as a data request's parsing would take
        while time.perf_counter() < until:
            pass
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    return app


async def burst(app: Any) -> list[str]:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://server") as client:
        data = [asyncio.create_task(client.get(f"/data/{n}")) for n in range(64)]
        await asyncio.sleep(0)
        control = asyncio.create_task(client.get(STATUS))
        await asyncio.gather(control, *data)
    return []


async def test_a_control_call_starts_ahead_of_a_burst_of_data_requests() -> None:
    order: list[str] = []
    await burst(ControlFirst(recording_app(order), per_turn=4))
    assert len(order) == 65 and order.index(STATUS) < 16
    plain: list[str] = []
    await burst(recording_app(plain))  # without it, the control call starts after the whole burst
    assert plain.index(STATUS) > 32


async def test_data_requests_wait_while_a_control_call_is_served_but_not_for_ever() -> None:
    order: list[str] = []
    hold = asyncio.Event()
    app = ControlFirst(recording_app(order, hold))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://server") as client:
        control = asyncio.create_task(client.get(STATUS))
        while STATUS not in order:
            await asyncio.sleep(0)
        began = time.monotonic()
        data = asyncio.create_task(client.get("/data/1"))
        await asyncio.sleep(0.1)
        assert order == [STATUS]  # held back while the control call runs
        await data
        assert time.monotonic() - began >= MAX_DEFER_S * 0.9  # then it went on by itself
        hold.set()
        await control


def test_checkpointing_puts_it_in_front_of_a_participant_and_nothing_when_off(tmp_path: Path) -> None:
    on = CheckpointConfig(enabled=True, control_auth_token="t", root=tmp_path)
    assert create_minimal_server("s", on).app.user_middleware[0].cls is ControlFirst
    assert ControlFirst not in [m.cls for m in create_minimal_server("s", CheckpointConfig()).app.user_middleware]
