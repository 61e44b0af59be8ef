"""Tools over MCP are covered by the checkpoint exactly like HTTP tool calls, in process.

kv_store (exported) with ``expose_tools_over_mcp: true``, driven by the official ``mcp`` client
(streamable HTTP over ``httpx.ASGITransport``): its tools are listed and answer the same JSON text
as over HTTP; a call that arrives while a checkpoint is open waits for the resume; a call in flight
blocks a prepare; retire stops the attempt's calls (refused ``stale_attempt``) and frees the
session only after its MCP call in flight ended; and the session state a checkpoint exports is the
same whether the tools were called over MCP or over HTTP.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from fastapi import FastAPI
from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client
from mcp.types import CallToolResult

from nemo_gym_ckpt.context import ServerContext
from nemo_gym_ckpt.testing.clock import FakeClock
from nemo_gym_ckpt.testing.conformance import Control, ParticipantUnderTest
from nemo_gym_ckpt.testing.resources import held, mesh_with, until_held
from resources_servers.kv_store.app import KvStore
from tests.unit.checkpoint.conftest import GRACE_S, TOKEN, until

pytestmark = pytest.mark.unit

NAME = "kv"
MCP_HEADERS = {"accept": "application/json, text/event-stream", "mcp-protocol-version": "2025-06-18"}
TOOLS_CALL = {"jsonrpc": "2.0", "id": 1, "method": "tools/call",
              "params": {"name": "kv_get", "arguments": {"key": "k"}}}
BASE = "http://kv"
WAIT_S = 10.0


@dataclass
class Running:
    server: Any
    app: FastAPI
    client: httpx.AsyncClient
    control: Control

    async def seed(self, key: str) -> dict[str, str]:
        reply = await self.client.post(f"/ng-rollout/{key}/seed_session", json={})
        assert reply.status_code == 200, reply.text
        return {"cookie": f"{self.server.cookie_name}={reply.cookies[self.server.cookie_name]}"}

    @asynccontextmanager
    async def mcp(self, key: str, cookie: dict[str, str]) -> AsyncIterator[ClientSession]:
        """An MCP client session of rollout ``key``, sending the resources cookie as an agent does."""
        transport = httpx.ASGITransport(self.app)
        async with (
            httpx.AsyncClient(transport=transport, base_url=BASE, headers=cookie, timeout=WAIT_S) as http,
            streamable_http_client(f"{BASE}/ng-rollout/{key}/mcp", http_client=http, terminate_on_close=False)
            as (read, write, _),
            ClientSession(read, write) as session,
        ):
            await session.initialize()
            yield session

    async def records(self, directory: Path, committed: dict[str, Any]) -> list[dict[str, Any]]:
        where = directory / "gym" / "resources" / NAME / committed["manifest"]["records_file"]
        return [orjson.loads(line) for line in where.read_bytes().splitlines()]


@asynccontextmanager
async def running(root: Path, clock: FakeClock, *, mcp: bool = True) -> AsyncIterator[Running]:
    checkpoint = {"enabled": True, "control_auth_token": TOKEN, "root": str(root), "lease_grace_seconds": GRACE_S}
    mesh = mesh_with("kv_store", NAME, checkpoint, {"expose_tools_over_mcp": mcp})
    ctx: ServerContext[Any] = ServerContext(NAME, mesh.instance(NAME).settings, mesh)
    server = held(KvStore)(ctx)
    app = server.build_app(clock=clock)
    try:
        async with app.router.lifespan_context(app), httpx.AsyncClient(
            transport=httpx.ASGITransport(app), base_url=BASE
        ) as client:
            pt = ParticipantUnderTest(client, TOKEN, root, now=clock.now, advance_clock=clock.advance)
            yield Running(server, app, client, Control(pt))
    finally:
        await ctx.aclose()


def text_of(result: CallToolResult) -> str:
    (item,) = result.content
    assert item.type == "text"
    return item.text


async def test_tools_over_mcp_are_listed_and_answer_as_over_http(root: Path, clock: FakeClock) -> None:
    async with running(root, clock) as on:
        cookie = await on.seed("r1")
        async with on.mcp("r1", cookie) as mcp:
            listed = {tool.name: tool for tool in (await mcp.list_tools()).tools}
            assert {"kv_set", "kv_get", "hold"} <= set(listed)
            assert listed["kv_set"].inputSchema["required"] == ["key", "value"]
            over_mcp = await mcp.call_tool("kv_set", {"key": "k", "value": "v"})
            assert not over_mcp.isError and json.loads(text_of(over_mcp)) == {"key": "k", "value": "v"}
            bad = await mcp.call_tool("kv_set", {"key": "k"})
            assert bad.isError and text_of(bad).startswith("invalid_request: value:")
        over_http = await on.client.post("/ng-rollout/r1/kv_get", json={"key": "k"}, headers=cookie)
        assert over_http.json() == {"key": "k", "value": "v", "found": True}


async def test_an_mcp_call_waits_while_a_checkpoint_is_open(root: Path, clock: FakeClock) -> None:
    async with running(root, clock) as on:
        cookie = await on.seed("r1")
        async with on.mcp("r1", cookie) as mcp:
            await on.control.ok("prepare", checkpoint_id="c1")
            call = asyncio.create_task(mcp.call_tool("kv_set", {"key": "k", "value": "late"}))
            await until(lambda: on.server.checkpoint.participant.status()["waiting_requests"] == 1)
            assert not call.done() and on.server.sessions.get(cookie["cookie"].split("=")[1]).state["items"] == {}
            await on.control.ok("resume", checkpoint_id="c1")
            result = await asyncio.wait_for(call, WAIT_S)
            assert not result.isError and json.loads(text_of(result))["value"] == "late"


async def test_an_mcp_call_without_a_prefix_is_admitted_under_its_sessions_rollout(
    root: Path, clock: FakeClock
) -> None:
    """NeMo Gym's callers send no ``/ng-rollout/`` prefix: an HTTP tool call then runs under its session
    cookie's rollout, and so does an MCP call (it was 400 ``rollout_id_required``)."""
    async with running(root, clock) as on:
        cookie = await on.seed("r1")
        headers = {**cookie, **MCP_HEADERS}
        set_k = {**TOOLS_CALL, "params": {"name": "kv_set", "arguments": {"key": "k", "value": "v"}}}
        reply = await on.client.post("/mcp", json=set_k, headers=headers)
        assert reply.status_code == 200 and not reply.json()["result"]["isError"], reply.text
        assert (await on.client.post("/kv_get", json={"key": "k"}, headers=cookie)).json()["value"] == "v"
        await on.control.ok("prepare", checkpoint_id="c1")
        call = asyncio.create_task(on.client.post("/mcp", json=TOOLS_CALL, headers=headers))
        await until(lambda: on.server.checkpoint.participant.status()["waiting_requests"] == 1)
        assert not call.done()  # admitted as r1's tool call: it waits for the resume
        await on.control.ok("resume", checkpoint_id="c1")
        waited = await asyncio.wait_for(call, WAIT_S)
        assert json.loads(waited.json()["result"]["content"][0]["text"]) == {"key": "k", "value": "v", "found": True}


async def test_an_mcp_call_in_flight_blocks_a_prepare_like_an_http_call(root: Path, clock: FakeClock) -> None:
    async with running(root, clock) as on:
        cookie = await on.seed("r1")
        async with on.mcp("r1", cookie) as mcp:
            hold = asyncio.create_task(mcp.call_tool("hold", {}))
            await until_held(on.client, "r1", hold)
            deadline = clock.now() + 1
            prepare = asyncio.create_task(on.control.ok("prepare", checkpoint_id="c1", deadline_ts=deadline))
            await until(lambda: on.server.checkpoint.participant.status()["report"] is not None)
            clock.advance(2)
            reply = await asyncio.wait_for(prepare, WAIT_S)
            assert reply["report"]["blockers"] == ["r1"] and reply["phase"] == "preparing"
            await on.control.ok("resume", checkpoint_id="c1")
            await on.client.post("/_test/release/r1")
            assert text_of(await asyncio.wait_for(hold, WAIT_S)) == '"released"'


async def test_retire_stops_the_attempts_mcp_calls_and_frees_after_the_one_in_flight(
    root: Path, clock: FakeClock
) -> None:
    async with running(root, clock) as on:
        cookie = await on.seed("r1")
        async with on.mcp("r1", cookie) as mcp:
            await mcp.list_tools()  # the client checks results against the listed tools: list them before the fence
            hold = asyncio.create_task(mcp.call_tool("hold", {}))
            await until_held(on.client, "r1", hold)
            retire = asyncio.create_task(on.control.ok(
                "retire", checkpoint_id="h1", episode_ids=[{"rollout_id": "r1", "attempt": 0}]))
            await until(lambda: on.server.checkpoint.status_extras()["retiring_sessions"] == 1)
            refused = await on.client.post("/ng-rollout/r1/mcp", json=TOOLS_CALL, headers={**cookie, **MCP_HEADERS})
            assert (refused.status_code, refused.json()["error"]["code"]) == (409, "stale_attempt")  # fenced
            assert len(on.server.sessions) == 1 and not retire.done()  # its call still runs: not freed
            await on.client.post("/_test/release/r1")
            await asyncio.wait_for(hold, WAIT_S)
            assert (await asyncio.wait_for(retire, WAIT_S)) == {"retired": ["r1"]}
            assert len(on.server.sessions) == 0


async def test_the_exported_state_is_the_same_over_mcp_and_over_http(root: Path, clock: FakeClock) -> None:
    steps = [("kv_set", {"key": "a", "value": "1"}), ("kv_set", {"key": "b", "value": "2"}),
             ("kv_delete", {"key": "a"}), ("kv_set", {"key": "c", "value": "3"})]
    async with running(root, clock) as on:
        over_http, over_mcp = await on.seed("h"), await on.seed("m")
        for tool, args in steps:
            reply = await on.client.post(f"/ng-rollout/h/{tool}", json=args, headers=over_http)
            assert reply.status_code == 200, reply.text
        async with on.mcp("m", over_mcp) as mcp:
            for tool, args in steps:
                result = await mcp.call_tool(tool, args)
                assert not result.isError, text_of(result)
        await on.control.ok("prepare", checkpoint_id="c1")
        committed = await on.control.ok("commit", checkpoint_id="c1", checkpoint_dir=str(root / "ck"))
        await on.control.ok("resume", checkpoint_id="c1")
    records = await on.records(root / "ck", committed)
    states = {record["episode_id"]["rollout_id"]: record["state"] for record in records}
    assert states["h"] == states["m"] == {"items": {"b": "2", "c": "3"}}


@pytest.mark.parametrize("levels", [300, 1100])
async def test_an_mcp_body_the_mesh_cannot_read_and_write_again_is_a_400(
    root: Path, clock: FakeClock, levels: int
) -> None:
    """The mcp package reads a body with the standard library: past 254 levels it answered a JSON-RPC
    error (no part of the mesh could write the call again), past about 1,000 a 500 (RecursionError)."""
    call = {**TOOLS_CALL, "params": {"name": "kv_set", "arguments": {"key": "k", "value": "v"}, "_meta": {"deep": 0}}}
    body = orjson.dumps(call).replace(b'"deep":0', b'"deep":' + b"[" * levels + b"1" + b"]" * levels)
    async with running(root, clock) as on:
        cookie = await on.seed("r1")
        reply = await on.client.post("/ng-rollout/r1/mcp", content=body,
                                     headers={**cookie, **MCP_HEADERS, "content-type": "application/json"})
        assert (reply.status_code, reply.json()["error"]["code"]) == (400, "invalid_request"), reply.text
        assert on.server.sessions.get(cookie["cookie"].split("=")[1]).state["items"] == {}  # never called


async def test_without_the_setting_there_is_no_mcp_route(root: Path, clock: FakeClock) -> None:
    async with running(root, clock, mcp=False) as on:
        reply = await on.client.post("/ng-rollout/r1/mcp", json={})
        assert (reply.status_code, reply.json()["error"]["code"]) == (404, "not_found")
