"""Fixtures of the policy model's tests: the test tokenizer, a scripted worker, the app in process."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from model_servers.policy_model.app import Config, create_app
from model_servers.policy_model.chat_format import ChatFormat, load_chat_format
from model_servers.policy_model.tests.chat_tokenizer import build_chat_tokenizer
from model_servers.policy_model.tests.scripted_worker import ScriptedWorker
from nemo_gym_ckpt.client import MeshClient
from nemo_gym_ckpt.config import load_config_dict
from nemo_gym_ckpt.context import ServerContext

os.environ.setdefault("HF_HUB_OFFLINE", "1")

WORKER_REF = {"type": "responses_api_models", "name": "inference_worker"}


def policy_ctx(client: MeshClient, worker_port: int = 9, **settings: Any) -> ServerContext[Config]:
    """A two-server mesh (inference worker + policy model) and the policy model's context in it."""
    raw = {
        "inference_worker": {"responses_api_models": {"inference_worker": {"port": worker_port}}},
        "policy_model": {"responses_api_models": {"policy_model": settings}},
    }
    mesh = load_config_dict(raw)
    instance = mesh.instance("policy_model")
    assert isinstance(instance.settings, Config)
    return ServerContext(name="policy_model", settings=instance.settings, mesh=mesh, client=client)


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_chat_tokenizer(tmp_path_factory.mktemp("chat-tokenizer"))


@pytest.fixture(scope="session")
def fmt(tokenizer_dir: Path) -> ChatFormat:
    return load_chat_format(tokenizer_dir)


@pytest.fixture
def worker(fmt: ChatFormat) -> ScriptedWorker:
    return ScriptedWorker(fmt)


PolicyClient = Callable[..., AbstractAsyncContextManager[httpx.AsyncClient]]


@pytest.fixture
def policy_client(worker: ScriptedWorker, tokenizer_dir: Path) -> PolicyClient:
    """``async with policy_client(**settings) as http``: the policy app in process, its lifespan run,
    talking to the scripted worker over ``httpx.ASGITransport`` (with a ``MeshClient`` made with
    ``client_options``, when given)."""

    @asynccontextmanager
    async def open_client(
        *, client_options: dict[str, Any] | None = None, **settings: Any
    ) -> AsyncIterator[httpx.AsyncClient]:
        settings = {"worker": WORKER_REF, "tokenizer_path": str(tokenizer_dir), **settings}
        mesh_client = MeshClient(transport=httpx.ASGITransport(app=worker.app), **(client_options or {}))
        app = create_app(policy_ctx(mesh_client, **settings))
        async with mesh_client, app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://policy", timeout=10) as http:
                yield http

    return open_client
