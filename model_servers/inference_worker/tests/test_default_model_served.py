"""The worker with no model named serves the embedded default model (offline, on the CPU)."""

from __future__ import annotations

import random

import httpx
import pytest

from model_servers.inference_worker import default_model_data as data
from model_servers.inference_worker.app import create_app
from model_servers.inference_worker.model_dir import DEFAULT_MODEL_DIR, resolve_model_path
from model_servers.inference_worker.tests.conftest import make_ctx

pytest.importorskip("transformers")
pytestmark = pytest.mark.unit


def test_default_model_path_resolves() -> None:
    assert resolve_model_path(None) == DEFAULT_MODEL_DIR
    assert (DEFAULT_MODEL_DIR / "tokenizer_config.json").is_file()


async def test_default_model_answers_with_a_tool_call() -> None:
    problem = data.make_problem(random.Random(0))
    app = create_app(make_ctx())
    async with app.router.lifespan_context(app), httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://worker", timeout=60
    ) as http:
        models = (await http.get("/v1/models")).json()
        reply = await http.post("/v1/completions", json={
            "prompt": data.render_prompt(problem), "max_tokens": 80, "temperature": 0,
            "return_token_ids": True, "logprobs": 1,
        })
    assert models["data"][0]["id"] == "nemo-gym-ckpt-tiny"
    choice = reply.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] is None
    assert choice["token_ids"][-1] == data.SPECIAL_TOKENS.index(data.END)
    assert data.parse_tool_calls(choice["text"]) is not None, choice["text"]
