"""A ``/run`` past the environment's capacity is refused by the outermost middleware (``RunAdmission``),
ahead of ``ControlFirst``: while a control call is served, and in a burst, a refusal waits for nothing.

Built as the environment's server process builds its app (checkpointing on and off); a control call
is held open by a route under ``/ng-control/`` added for the test (``ControlFirst`` keys on the path),
and the one ``/run`` slot by a body that stops arriving.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from nemo_gym_ckpt.checkpoint import priority as priority_module
from nemo_gym_ckpt.checkpoint.pacer import Pacer
from nemo_gym_ckpt.config import load_config_dict
from nemo_gym_ckpt.launch.child import build_app
from tests.unit.test_every_route_refuses_garbage import MESH

pytestmark = pytest.mark.unit

JSON = {"content-type": "application/json"}
ENV = "single_agent_turn"


def environment_app(*, checkpointing: bool, limit: int = 1) -> FastAPI:
    mesh = dict(MESH)
    mesh["checkpoint"] = {**MESH["checkpoint"], "enabled": checkpointing}
    block = mesh[ENV]["environment_servers"][ENV]
    mesh[ENV] = {"environment_servers": {ENV: {**block, "max_rollouts_in_flight": limit}}}
    return build_app(load_config_dict(mesh), ENV)


async def stalled(never: asyncio.Event) -> AsyncIterator[bytes]:
    yield b'{"responses_create_params": '
    await never.wait()


async def holding_the_slot(http: httpx.AsyncClient, never: asyncio.Event) -> asyncio.Task[httpx.Response]:
    """A ``/run`` whose body never ends: it holds the one slot until the test lets the connection go."""
    task = asyncio.create_task(http.post("/ng-rollout/held/run", content=stalled(never), headers=JSON))
    for _ in range(1000):
        await asyncio.sleep(0.001)
        if (await http.post("/ng-rollout/probe/run", content=b"[]", headers=JSON)).status_code == 429:
            return task
    raise AssertionError("the stalled /run never took the slot")


async def test_a_run_past_capacity_is_refused_while_a_control_call_is_served(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(priority_module, "MAX_DEFER_S", 60.0)  # data requests wait out a control call
    app = environment_app(checkpointing=True)
    release, entered = asyncio.Event(), asyncio.Event()

    @app.get("/ng-control/test-hold")
    async def hold() -> dict[str, str]:
        entered.set()
        await release.wait()
        return {}

    never = asyncio.Event()
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as http:
        held = await holding_the_slot(http, never)
        control = asyncio.create_task(http.get("/ng-control/test-hold"))
        await asyncio.wait_for(entered.wait(), 10)
        refused = await asyncio.wait_for(http.post("/run", content=b"{}", headers=JSON), 10)
        prefixed = await asyncio.wait_for(http.post("/ng-rollout/r9/run", content=b"{}", headers=JSON), 10)
        assert not control.done()  # answered while the control call still held every data request
        release.set()
        await control
        held.cancel()
    for reply in (refused, prefixed):
        assert reply.status_code == 429, reply.text
        assert reply.json()["error"]["code"] == "capacity_exceeded" and reply.headers["retry-after"] == "1"


@pytest.mark.parametrize("checkpointing", [True, False])
async def test_a_burst_of_refusals_takes_no_turn_of_the_pacer(
    monkeypatch: pytest.MonkeyPatch, checkpointing: bool
) -> None:
    turns = 0
    pace = Pacer.turn

    async def counted(self: Pacer) -> None:
        nonlocal turns
        turns += 1
        await pace(self)

    monkeypatch.setattr(Pacer, "turn", counted)
    never = asyncio.Event()
    async with httpx.AsyncClient(transport=httpx.ASGITransport(environment_app(checkpointing=checkpointing)),
                                 base_url="http://t") as http:
        held = await holding_the_slot(http, never)
        before = turns
        replies = await asyncio.gather(*(http.post(f"/ng-rollout/b{n}/run", content=b"{}", headers=JSON)
                                         for n in range(64)))
        after = turns
        other: Any = await http.get("/run")  # not a POST: the app answers it, slot or not
        held.cancel()
    assert [reply.status_code for reply in replies] == [429] * 64
    assert after == before  # none of them waited in ControlFirst's line
    assert other.status_code == 405
