"""Fixtures of the inference worker's tests: contexts, an in-process client, the tiny model."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from model_servers.inference_worker.app import Config, create_app
from model_servers.inference_worker.engine import Engine
from nemo_gym_ckpt.config import load_config_dict
from nemo_gym_ckpt.context import ServerContext

os.environ.setdefault("HF_HUB_OFFLINE", "1")
TOKEN = "s3cret-token"


def make_ctx(checkpoint: bool = False, **settings: Any) -> ServerContext[Config]:
    raw: dict[str, Any] = {"worker": {"responses_api_models": {"inference_worker": settings}}}
    if checkpoint:
        raw["checkpoint"] = {"enabled": True, "control_auth_token": TOKEN}
    mesh = load_config_dict(raw)
    instance = mesh.instance("worker")
    assert isinstance(instance.settings, Config)
    return ServerContext(name="worker", settings=instance.settings, mesh=mesh)


WorkerClient = Callable[..., AbstractAsyncContextManager[httpx.AsyncClient]]


@pytest.fixture
def worker_client() -> WorkerClient:
    """``async with worker_client(engine, **settings) as http``: the app over ASGITransport, started."""

    @asynccontextmanager
    async def open_client(engine: Engine, checkpoint: bool = False, **settings: Any) -> AsyncIterator[
        httpx.AsyncClient
    ]:
        async def factory(_: Config) -> Engine:
            return engine

        app = create_app(make_ctx(checkpoint, **settings), engine_factory=factory)
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://worker", timeout=10) as http:
                yield http

    return open_client


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from model_servers.inference_worker.tests.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))
