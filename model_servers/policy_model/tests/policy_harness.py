"""The policy model as a checkpoint participant under test: its app over a scripted worker.

``serve_policy`` builds the server from a mesh config (checkpointing on when a ``root`` is given,
``checkpoint_policy: true`` unless told otherwise), runs its lifespan, and yields an httpx client
that reaches it in process through ``StreamingASGITransport`` (or, with ``uvicorn=True``, over a
real socket). ``PolicyHooks`` is the model's data plane for the conformance suite: a request is one
chat call of the episode (one ledger row); blocking is a stream that started to be delivered and
is kept open by the scripted worker's gate.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import orjson

from model_servers.policy_model.app import Config, create_app
from model_servers.policy_model.generation import MODEL_CALL_HEADER
from model_servers.policy_model.tests.scripted_worker import Generate, ScriptedWorker
from model_servers.policy_model.tests.streaming_asgi import StreamingASGITransport
from model_servers.policy_model.tests.uvicorn_server import serving
from nemo_gym_ckpt.checkpoint.clock import SYSTEM_CLOCK, Clock
from nemo_gym_ckpt.client import MeshClient
from nemo_gym_ckpt.config import load_config_dict
from nemo_gym_ckpt.context import ServerContext
from nemo_gym_ckpt.identity import RolloutIdentity

__all__ = [
    "INSTANCE",
    "TOKEN",
    "PolicyHooks",
    "chat_body",
    "chat_url",
    "ledger_records",
    "policy_context",
    "serve_policy",
]

TOKEN = "policy-model-test-token"
INSTANCE = "policy_model"
WAIT_S = 10.0
WORKER_REF = {"type": "responses_api_models", "name": "inference_worker"}


def policy_context(
    client: MeshClient, tokenizer_dir: Path, root: Path | None, grace_s: float, *, worker_port: int = 9,
    **settings: Any,
) -> ServerContext[Config]:
    raw: dict[str, Any] = {
        "inference_worker": {"responses_api_models": {"inference_worker": {"port": worker_port}}},
        INSTANCE: {"responses_api_models": {INSTANCE: {"worker": WORKER_REF, "tokenizer_path": str(tokenizer_dir),
                                                "checkpoint_policy": True, **settings}}},
    }
    if root is not None:
        raw["checkpoint"] = {"enabled": True, "control_auth_token": TOKEN, "root": str(root),
                             "lease_grace_seconds": grace_s}
    mesh = load_config_dict(raw)
    settings_ = mesh.instance(INSTANCE).settings
    assert isinstance(settings_, Config)
    return ServerContext(INSTANCE, settings_, mesh, client)


@asynccontextmanager
async def serve_policy(
    worker: ScriptedWorker,
    tokenizer_dir: Path,
    *,
    root: Path | None,
    clock: Clock = SYSTEM_CLOCK,
    grace_s: float = 600.0,
    uvicorn: bool = False,
    **settings: Any,
) -> AsyncIterator[httpx.AsyncClient]:
    """The policy app (its lifespan run) and a client to it."""
    ctx = policy_context(MeshClient(transport=StreamingASGITransport(worker.app)), tokenizer_dir, root,
                         grace_s, **settings)
    app = create_app(ctx, clock=clock)
    async with ctx.client:
        if uvicorn:
            async with serving(app) as port, httpx.AsyncClient(
                base_url=f"http://127.0.0.1:{port}", timeout=WAIT_S
            ) as http:
                yield http
            return
        transport = StreamingASGITransport(app)
        async with app.router.lifespan_context(app), httpx.AsyncClient(
            transport=transport, base_url="http://policy", timeout=WAIT_S
        ) as http:
            yield http


def chat_url(episode: RolloutIdentity | None) -> str:
    prefix = "" if episode is None else f"/ng-rollout/{episode.capture_key}"
    return f"{prefix}/v1/chat/completions"


def chat_body(text: str, **extra: Any) -> dict[str, Any]:
    return {"model": "policy", "messages": [{"role": "user", "content": text}], **extra}


def ledger_records(root: Path, commit_reply: dict[str, Any]) -> list[dict[str, Any]]:
    """The records a commit wrote (found through the manifest it answered)."""
    manifest = commit_reply["manifest"]
    for where in root.rglob(manifest["records_file"]):
        return [orjson.loads(line) for line in where.read_bytes().splitlines()]
    raise AssertionError(f"no {manifest['records_file']} under {root}")


class PolicyHooks:
    """The model's data plane as the conformance suite's ``DataHooks``."""

    def __init__(self, worker: ScriptedWorker) -> None:
        self.worker = worker
        self._open: dict[str, tuple[asyncio.Event, asyncio.Task[None]]] = {}
        self.call_ids: list[str] = []  # the model call ids the blocking streams were named with

    async def request(
        self, client: httpx.AsyncClient, episode: RolloutIdentity, payload: dict[str, Any]
    ) -> httpx.Response:
        text = orjson.dumps(payload).decode()[:80]
        return await client.post(chat_url(episode), json=chat_body(text))

    async def block(self, client: httpx.AsyncClient, episode: RolloutIdentity, blocked: bool) -> None:
        if blocked:
            self._open[episode.capture_key] = await self._start_stream(client, episode)
            return
        gate, task = self._open.pop(episode.capture_key)
        gate.set()
        await asyncio.wait_for(task, WAIT_S)

    async def _start_stream(
        self, client: httpx.AsyncClient, episode: RolloutIdentity
    ) -> tuple[asyncio.Event, asyncio.Task[None]]:
        gate, delivering = asyncio.Event(), asyncio.Event()
        self.worker.will(Generate("a long answer", gate=gate))

        async def consume() -> None:
            body = chat_body("go", stream=True)
            async with client.stream("POST", chat_url(episode), json=body) as response:
                assert response.status_code == 200, await response.aread()
                self.call_ids.append(response.headers[MODEL_CALL_HEADER])
                delivering.set()
                async for _ in response.aiter_bytes():
                    pass

        task = asyncio.create_task(consume())
        waiter = asyncio.ensure_future(delivering.wait())
        try:
            await asyncio.wait({task, waiter}, timeout=WAIT_S, return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
        if task.done():
            task.result()
        assert delivering.is_set(), "the stream did not start"
        return gate, task
