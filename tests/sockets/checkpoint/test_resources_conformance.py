"""Resources servers as checkpoint participants under real uvicorn (127.0.0.1).

The conformance suite over sockets for calculator_tools (stateless) and kv_store (exported); every
server, python_repl included, runs it in process too. And the acceptance check of exported state:
a kv_store rollout checkpointed mid-way and restored into a fresh server ends with the state and
verdict of an uninterrupted run, while the same continuation without the restore does not.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from nemo_gym_ckpt.client import MeshClient
from nemo_gym_ckpt.config import MeshConfig
from nemo_gym_ckpt.context import ServerContext
from nemo_gym_ckpt.errors import InvalidRequest
from nemo_gym_ckpt.identity import RolloutIdentity
from nemo_gym_ckpt.launch.child import build_app
from nemo_gym_ckpt.testing.conformance import CHECKS, Control, ParticipantUnderTest, check_participant
from nemo_gym_ckpt.testing.resources import held, mesh_with
from tests.support.resources_participants import SERVERS, hooks_for

pytestmark = pytest.mark.sockets

TOKEN = "sockets-resources-token"
NAME = "res"


def mesh(implementation: str, root: Path) -> MeshConfig:
    # A short grace lets the suite's lease check run on the real clock in well under a second.
    block = {"enabled": True, "control_auth_token": TOKEN, "root": str(root), "lease_grace_seconds": 0.5}
    return mesh_with(implementation, NAME, block)


@pytest.mark.parametrize("implementation", ["calculator_tools", "kv_store"])
async def test_conformance_over_sockets(
    implementation: str, serve_app: Callable[[Any], str], root: Path
) -> None:
    config = mesh(implementation, root)
    server_class = held(SERVERS[implementation])

    @asynccontextmanager
    async def make() -> AsyncIterator[ParticipantUnderTest]:
        ctx: ServerContext[Any] = ServerContext(NAME, config.instance(NAME).settings, config)
        url = serve_app(server_class(ctx).build_app())
        try:
            async with httpx.AsyncClient(base_url=url, timeout=30) as client:
                yield ParticipantUnderTest(client, TOKEN, root, data=hooks_for(implementation))
        finally:
            await ctx.aclose()

    results = await check_participant(make)
    assert results == {name: "passed" for name in CHECKS}


# ---- exported state after restore equals an uninterrupted run's ---------------------------------

INITIAL = {"x": "0", "keep": "k"}
BEFORE = [
    ("kv_set", {"key": "a", "value": "1"}),
    ("kv_set", {"key": "b", "value": "2"}),
    ("kv_delete", {"key": "x"}),
]
AFTER = [
    ("kv_set", {"key": "c", "value": "3"}),
    ("kv_get", {"key": "a"}),
    ("kv_delete", {"key": "a"}),
    ("kv_list", {}),
]
EXPECTED = {"b": "2", "c": "3", "keep": "k"}
EMPTY_RESPONSE: dict[str, Any] = {"output": []}


class Rollout:
    """One kv_store rollout driven as an agent does: the session cookie passed explicitly."""

    def __init__(self, client: MeshClient, url: str, identity: RolloutIdentity) -> None:
        self.client, self.url, self.identity = client, url, identity
        self.cookies: dict[str, str] = {}

    async def seed(self) -> None:
        reply = await self.client.request(
            "POST", f"{self.url}/seed_session", json={"initial_state": INITIAL}, identity=self.identity
        )
        self.cookies = dict(reply.cookies)

    async def run(self, steps: list[tuple[str, dict[str, Any]]]) -> list[Any]:
        return [
            await self.client.post_json(
                f"{self.url}/{name}", args, cookies=self.cookies, identity=self.identity
            )
            for name, args in steps
        ]

    async def verify(self) -> dict[str, Any]:
        row = {"expected_state": EXPECTED, "response": EMPTY_RESPONSE}
        verdict: dict[str, Any] = await self.client.post_json(
            f"{self.url}/verify", row, cookies=self.cookies, identity=self.identity
        )
        return verdict


@asynccontextmanager
async def control_of(url: str, root: Path) -> AsyncIterator[Control]:
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        yield Control(ParticipantUnderTest(http, TOKEN, root))


async def test_exported_state_after_restore_equals_an_uninterrupted_run(
    serve_app: Callable[[Any], str], root: Path
) -> None:
    config = mesh("kv_store", root)
    first, directory = RolloutIdentity("kv-1"), str(root / "ck-1")
    async with MeshClient(transport="httpx") as client:
        uninterrupted = Rollout(client, serve_app(build_app(config, NAME)), first)
        await uninterrupted.seed()
        expected_replies = await uninterrupted.run(BEFORE + AFTER)
        expected_verdict = await uninterrupted.verify()
        assert expected_verdict["reward"] == 1.0

        crashed = Rollout(client, serve_app(build_app(config, NAME)), first)
        await crashed.seed()
        assert await crashed.run(BEFORE) == expected_replies[: len(BEFORE)]
        async with control_of(crashed.url, root) as ctl:
            await ctl.ok("prepare", checkpoint_id="c1")
            await ctl.ok(
                "commit", checkpoint_id="c1", checkpoint_dir=directory, episode_ids=[first.to_json()]
            )
            await ctl.ok("resume", checkpoint_id="c1")

        restored = Rollout(client, serve_app(build_app(config, NAME)), first.next_attempt())
        restored.cookies = crashed.cookies  # the environment's boundary kept them
        async with control_of(restored.url, root) as ctl:
            scope = [first.to_json()]
            reply = await ctl.ok("restore", checkpoint_id="r1", checkpoint_dir=directory, episode_ids=scope)
            assert reply["restored"] == ["kv-1-a1"]
            await ctl.ok("resume", checkpoint_id="r1")
        assert await restored.run(AFTER) == expected_replies[len(BEFORE) :]
        assert await restored.verify() == expected_verdict

        without = Rollout(client, serve_app(build_app(config, NAME)), first.next_attempt())
        without.cookies = crashed.cookies
        with pytest.raises(InvalidRequest, match="unknown session"):
            await without.run(AFTER)
        await without.seed()  # what a restart would do: start the session over
        assert await without.run(AFTER) != expected_replies[len(BEFORE) :]
        negative = await without.verify()
        assert negative["reward"] == 0.0 and negative["final_state"] != expected_verdict["final_state"]
