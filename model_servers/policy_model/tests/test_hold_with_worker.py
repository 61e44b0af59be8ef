"""The generation hold over real sockets: the policy model and the real inference worker on uvicorn.

With ``hold_generation_in_checkpoints``, a call generating when the policy model becomes ready
inside a checkpoint takes no token from then to the resume (but the one step already running), and
ends exactly as an uninterrupted
call; a hold the worker cannot take (the policy model pointed at a server without the routes) is
counted and the checkpoint goes on.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from model_servers.inference_worker.app import create_app as create_worker_app
from model_servers.policy_model.app import create_app
from model_servers.policy_model.tests.uvicorn_server import serving
from nemo_gym_ckpt.bench.cuts import PROMPT
from nemo_gym_ckpt.checkpoint.hold_wire import HOLD_ROUTE
from nemo_gym_ckpt.checkpoint.router import CONTROL_PREFIX
from nemo_gym_ckpt.client import MeshClient
from nemo_gym_ckpt.config import load_config_dict
from nemo_gym_ckpt.context import ServerContext

pytestmark = [pytest.mark.sockets, pytest.mark.timeout(240)]

TOKEN = "hold-socket-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}
WORKER_REF = {"type": "responses_api_models", "name": "inference_worker"}
BODY = {"model": "tiny", "messages": [{"role": "user", "content": PROMPT}], "seed": 11}
HELD_S = 0.5
WAIT_S = 60.0


def context(name: str, root: Path, worker_port: int | None = None, **policy: Any) -> ServerContext[Any]:
    worker: dict[str, Any] = {"torch_threads": 1, "staging_dir": str(root / "staging")}
    if worker_port is not None:
        worker["port"] = worker_port
    settings = {"worker": WORKER_REF, "return_token_ids": True, "max_tokens": 120, "checkpoint_policy": True,
                "hold_generation_in_checkpoints": True, **policy}
    mesh = load_config_dict({
        "checkpoint": {"enabled": True, "control_auth_token": TOKEN, "root": str(root)},
        "inference_worker": {"responses_api_models": {"inference_worker": worker}},
        "policy_model": {"responses_api_models": {"policy_model": settings}},
    })
    return ServerContext(name, mesh.instance(name).settings, mesh, MeshClient())


@asynccontextmanager
async def servers(root: Path, **policy: Any) -> AsyncIterator[tuple[httpx.AsyncClient, httpx.AsyncClient]]:
    """A worker and a policy model on uvicorn; clients to (policy, worker)."""
    async with serving(create_worker_app(context("inference_worker", root))) as worker_port:
        ctx = context("policy_model", root, worker_port, **policy)
        async with ctx.client, serving(create_app(ctx)) as port, httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{port}", timeout=WAIT_S
        ) as policy_http, httpx.AsyncClient(base_url=f"http://127.0.0.1:{worker_port}", timeout=WAIT_S) as worker:
            yield policy_http, worker


async def chat(policy: httpx.AsyncClient, capture_key: str) -> list[int]:
    reply = await policy.post(f"/ng-rollout/{capture_key}/v1/chat/completions", json=BODY)
    assert reply.status_code == 200, reply.text
    ids: list[int] = reply.json()["choices"][0]["message"]["generation_token_ids"]
    return ids


async def control(policy: httpx.AsyncClient, op: str, **body: Any) -> dict[str, Any]:
    body = {"deadline_ts": time.time() + WAIT_S, **body}
    reply = await policy.post(f"{CONTROL_PREFIX}/{op}", json=body, headers=AUTH)
    assert reply.status_code == 200, f"{op}: {reply.text}"
    result: dict[str, Any] = reply.json()
    return result


async def get(client: httpx.AsyncClient, path: str) -> dict[str, Any]:
    reply = await client.get(path, headers=AUTH)
    assert reply.status_code == 200, reply.text
    result: dict[str, Any] = reply.json()
    return result


async def until(client: httpx.AsyncClient, path: str, check: Any) -> dict[str, Any]:
    deadline = time.monotonic() + WAIT_S
    while not check(body := await get(client, path)):
        assert time.monotonic() < deadline, f"{path} never got there: {body}"
        await asyncio.sleep(0.005)
    return body


def generated(status: dict[str, Any], capture_key: str) -> int:
    return next((g["tokens"] for g in status["live_generations"] if g["capture_key"] == capture_key), 0)


async def test_a_call_takes_no_token_from_ready_to_resume_and_ends_unchanged(tmp_path: Path) -> None:
    cuts = "/ng-control/v1/generation-cut/status"
    async with servers(tmp_path) as (policy, worker):
        uninterrupted = await chat(policy, "ref")
        running = asyncio.ensure_future(chat(policy, "r1"))
        await until(worker, cuts, lambda status: generated(status, "r1") >= 8)
        assert (await control(policy, "prepare", checkpoint_id="c1"))["report"]["ready"]
        await until(worker, HOLD_ROUTE, lambda status: status["held_by"] == "c1")
        before = generated(await get(worker, cuts), "r1")
        await asyncio.sleep(HELD_S)
        during = generated(await get(worker, cuts), "r1") - before
        await control(policy, "commit", checkpoint_id="c1", checkpoint_dir=str(tmp_path / "c1"))
        await control(policy, "resume", checkpoint_id="c1")
        held = await until(worker, HOLD_ROUTE, lambda status: status["held_by"] is None)
        ended = await asyncio.wait_for(running, WAIT_S)
        extras = (await get(policy, f"{CONTROL_PREFIX}/status"))["extras"]
    assert during <= 1 and not running.cancelled()  # at most the step running when the hold came
    assert ended == uninterrupted
    assert (held["holds"], held["releases"], held["expired"]) == (1, 1, 0)
    assert extras["releases_sent"] == 1 and extras["hold_failures"] == 0 and extras["holds_sent"] >= 1


async def test_a_hold_that_fails_is_counted_and_the_checkpoint_goes_on(tmp_path: Path) -> None:
    nowhere = "http://127.0.0.1:9"  # nothing listens there: every hold and release fails
    async with servers(tmp_path, generation_cut_url=nowhere) as (policy, _):
        assert (await control(policy, "prepare", checkpoint_id="c1"))["report"]["ready"]
        committed = await control(policy, "commit", checkpoint_id="c1", checkpoint_dir=str(tmp_path / "c1"))
        await control(policy, "resume", checkpoint_id="c1")
        deadline = time.monotonic() + WAIT_S
        while (extras := (await get(policy, f"{CONTROL_PREFIX}/status"))["extras"])["hold_failures"] < 3:
            assert time.monotonic() < deadline, extras
            await asyncio.sleep(0.01)
        answered = await chat(policy, "r2")
    assert committed["phase"] == "committed" and answered
    assert extras["holds_sent"] == 0 and extras["releases_sent"] == 0
