"""The model's cut requests travel over a pool of their own, to the backend's control url.

Real sockets: the scripted worker (which answers upstream's cut wire) on uvicorn, the policy model's
data client limited to two connections, both held by generations in flight. A cut sent over the
data pool would queue behind the very generations it cuts until its half of the deadline ran out;
over the reserved pool it reaches the worker at once. ``generation_cut_url`` sends the cuts to
another address than the worker's (a backend that serves cuts elsewhere, as a NeMo RL-hosted
engine does), and only there.
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

from model_servers.policy_model.app import create_app
from model_servers.policy_model.chat_format import ChatFormat
from model_servers.policy_model.tests.policy_harness import TOKEN, chat_body, chat_url, policy_context
from model_servers.policy_model.tests.scripted_worker import Generate, ScriptedWorker
from model_servers.policy_model.tests.streaming_asgi import StreamingASGITransport
from model_servers.policy_model.tests.uvicorn_server import serving
from nemo_gym_ckpt.client import MeshClient
from nemo_gym_ckpt.identity import RolloutIdentity
from nemo_gym_ckpt.testing.conformance import Control, ParticipantUnderTest, unique

pytestmark = pytest.mark.sockets

WAIT_S = 10.0
DATA_CONNECTIONS = 2
COMMIT_S = 20.0
"""The commit's deadline: a cut queued behind the generations would wait out half of it (10 s); one
over its own pool is in at once, with room for a loaded machine's real sockets and fsyncs."""


@asynccontextmanager
async def policy_over_sockets(
    worker: ScriptedWorker, tokenizer_dir: Path, root: Path, **settings: Any
) -> AsyncIterator[tuple[httpx.AsyncClient, Control]]:
    async with serving(worker.app) as port:
        ctx = policy_context(MeshClient(max_connections=DATA_CONNECTIONS), tokenizer_dir, root, 600.0,
                             worker_port=port, generation_cuts=True, **settings)
        app = create_app(ctx)
        async with ctx.client, app.router.lifespan_context(app), httpx.AsyncClient(
            transport=StreamingASGITransport(app), base_url="http://policy", timeout=WAIT_S
        ) as http:
            yield http, Control(ParticipantUnderTest(http, TOKEN, root))


async def generations_in_flight(
    http: httpx.AsyncClient, worker: ScriptedWorker, count: int
) -> tuple[list[asyncio.Task[Any]], asyncio.Event]:
    gate = asyncio.Event()
    tasks = []
    for n in range(count):
        started = asyncio.Event()
        worker.will(Generate(f"long answer {n}", started=started, gate=gate))
        episode = RolloutIdentity(f"r{n}")
        tasks.append(asyncio.create_task(http.post(chat_url(episode), json=chat_body(f"q{n}"))))
        await asyncio.wait_for(started.wait(), WAIT_S)
    return tasks, gate


async def test_a_cut_does_not_wait_behind_the_generations_holding_the_data_pool(
    fmt: ChatFormat, tokenizer_dir: Path, root: Path
) -> None:
    worker = ScriptedWorker(fmt)
    async with policy_over_sockets(worker, tokenizer_dir, root) as (http, control):
        tasks, gate = await generations_in_flight(http, worker, DATA_CONNECTIONS)
        await control.ok("prepare", checkpoint_id="c1")
        began = time.monotonic()
        committed = await control.ok("commit", checkpoint_id="c1", checkpoint_dir=unique("c1"),
                                     deadline_ts=time.time() + COMMIT_S)
        took = time.monotonic() - began
        await control.ok("resume", checkpoint_id="c1")
        gate.set()
        replies = await asyncio.wait_for(asyncio.gather(*tasks), WAIT_S)
    assert len(worker.cut_requests) == 1, "the cut never reached the worker while the data pool was busy"
    assert len(committed["staging_keys"]) == DATA_CONNECTIONS and took < COMMIT_S / 2  # not its half-deadline
    assert all(reply.status_code == 200 for reply in replies)


async def test_cuts_go_to_the_backends_control_url(fmt: ChatFormat, tokenizer_dir: Path, root: Path) -> None:
    worker, elsewhere = ScriptedWorker(fmt), ScriptedWorker(fmt)
    async with serving(elsewhere.app) as cut_port, policy_over_sockets(
        worker, tokenizer_dir, root, generation_cut_url=f"http://127.0.0.1:{cut_port}"
    ) as (http, control):
        tasks, gate = await generations_in_flight(http, worker, 1)
        await control.ok("prepare", checkpoint_id="c1")
        committed = await control.ok("commit", checkpoint_id="c1", checkpoint_dir=unique("c1"))
        await control.ok("resume", checkpoint_id="c1")
        gate.set()
        await asyncio.wait_for(asyncio.gather(*tasks), WAIT_S)
    assert worker.cut_requests == [] and len(elsewhere.cut_requests) == 1
    assert len(committed["staging_keys"]) == 1
