"""A restored episode whose record has ``boundary: null`` starts over and leaves nothing behind.

The checkpoint caught the episode inside ``seed`` (a replay step): the resources server had
already opened the session and exported it, the environment had no boundary yet. After the
restore, attempt N+1 seeds again; the restored session it never learned the cookie of must not
outlive the episode (until a forget). Both participants restore from records of the shape they
export themselves, on fresh in-process apps, on the fake clock.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from nemo_gym_ckpt.checkpoint.router import CONTROL_PREFIX
from nemo_gym_ckpt.checkpoint.store import CheckpointStore, StopSignal
from nemo_gym_ckpt.context import ServerContext
from nemo_gym_ckpt.environment.episode import task_digest
from nemo_gym_ckpt.identity import RolloutIdentity
from nemo_gym_ckpt.testing.clock import FakeClock
from nemo_gym_ckpt.testing.placement import InProcess, closing_ctx, instance_at, mesh_of
from resources_servers.calculator_tools import app as calculator_app
from tests.support.episode_participants import TOKEN, WAIT_S, checkpoint_config, env_row, env_stack

pytestmark = pytest.mark.unit

AUTH = {"authorization": f"Bearer {TOKEN}"}
EPISODE = RolloutIdentity("r")
SESSION_ID = "0123456789abcdef0123456789abcdef"


def write_records(directory: Path, root: Path, kind: str, instance: str, records: list[dict[str, Any]]) -> None:
    writer = CheckpointStore(root).open_writer(directory, kind, instance, StopSignal())
    writer.write_lines([orjson.dumps(record) for record in records])
    writer.finish(kind, instance, "caught-in-seed")


async def control(client: httpx.AsyncClient, op: str, **body: Any) -> dict[str, Any]:
    if op == "status":
        reply = await client.get(f"{CONTROL_PREFIX}/status", headers=AUTH)
    else:
        reply = await client.post(f"{CONTROL_PREFIX}/{op}", json=body, headers=AUTH)
    assert reply.status_code == 200, f"{op}: {reply.status_code} {reply.text}"
    answer: dict[str, Any] = reply.json()
    return answer


async def until(condition: Any, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not await condition():
        assert time.monotonic() < deadline, f"never: {what}"
        await asyncio.sleep(0.001)


@asynccontextmanager
async def resources_participant(placement: InProcess, root: Path, clock: FakeClock) -> AsyncIterator[str]:
    """calculator_tools (stateless) with checkpointing on, on the fake clock."""
    settings = calculator_app.Config()
    mesh = mesh_of([instance_at("calculator_tools", "resources_servers", "calculator_tools", settings,
                                "http://127.0.0.1:1")], checkpoint_config(root))
    ctx = ServerContext("calculator_tools", settings, mesh, placement.mesh_client())
    app = closing_ctx(calculator_app.CalculatorTools(ctx).build_app(clock=clock), ctx)
    async with placement.run(app) as url:
        yield url


async def test_an_episode_that_starts_over_leaves_no_restored_session_behind(root: Path, clock: FakeClock) -> None:
    row = env_row("single_agent_turn")
    directory = root / "caught-in-seed"
    write_records(directory, root, "environment", "env",
                  [{"episode_id": EPISODE.to_json(), "task_digest": task_digest(row), "boundary": None}])
    write_records(directory, root, "resources", "calculator_tools",
                  [{"episode_id": EPISODE.to_json(), "session_id": SESSION_ID}])
    placement = InProcess()
    async with (
        resources_participant(placement, root, clock) as resources_url,
        env_stack("single_agent_turn", placement, checkpoint_config(root), clock,
                  resources_url=resources_url) as stack,
        placement.client(stack.url) as env,
        placement.client(resources_url) as resources,
    ):
        restore = {"checkpoint_id": "back", "deadline_ts": clock.now() + 30,
                   "checkpoint_dir": str(directory), "episode_ids": [{"rollout_id": "r"}]}
        for client in (env, resources):
            assert (await control(client, "restore", **restore))["restored"] == ["r-a1"]
        for client in (env, resources):
            await control(client, "resume", checkpoint_id="back", deadline_ts=clock.now() + 30)
        assert (await control(resources, "status"))["extras"]["restored_sessions"] == 1

        run = asyncio.create_task(env.post("/ng-rollout/r-a1/run", json=row))

        async def reseeded() -> bool:  # the episode started over: seeded, now in its agent activation
            return ("r-a1", "1") in stack.server.activations or run.done()

        await until(reseeded, "the episode is in its agent activation")
        extras = (await control(resources, "status"))["extras"]
        assert (extras["sessions"], extras["restored_sessions"]) == (1, 0)  # the new session replaced it
        (await stack.helpers["agent"].post("/_test/release_all")).raise_for_status()
        reply = await asyncio.wait_for(run, WAIT_S)
        assert reply.status_code == 200, reply.text
        assert (await control(resources, "status"))["extras"]["sessions"] == 0
