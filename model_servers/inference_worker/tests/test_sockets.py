"""The worker under real uvicorn: the official ``openai`` client, streaming, client disconnects."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from model_servers.inference_worker.app import Config, create_app
from model_servers.inference_worker.engine import Engine
from model_servers.inference_worker.tests.conftest import make_ctx
from model_servers.inference_worker.tests.scripted_engine import ScriptedEngine
from nemo_gym_ckpt.launch.head import ThreadedServer

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.sockets


@pytest.fixture
def serve() -> Iterator[Callable[..., str]]:
    servers: list[ThreadedServer] = []

    def start(engine: Engine | None = None, **settings: Any) -> str:
        async def scripted(_: Config) -> Engine:
            assert engine is not None
            return engine

        ctx = make_ctx(**settings)
        app = create_app(ctx) if engine is None else create_app(ctx, engine_factory=scripted)
        server = ThreadedServer(app, name="inference-worker")
        server.start(timeout_s=60)
        servers.append(server)
        return server.url

    yield start
    for server in servers:
        server.stop()


def wait_until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met before the deadline"
        time.sleep(0.01)


def test_openai_client_against_the_transformers_engine(
    serve: Callable[..., str], tiny_model_dir: Path
) -> None:
    url = serve(model_path=str(tiny_model_dir), served_model_name="tiny", policy_version=9)
    with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30) as client:
        assert [m.id for m in client.models.list().data] == ["tiny"]
        prompt = [1, 40, 45, 52, 52, 55]
        extra_body = {"return_token_ids": True, "ignore_eos": True}
        done = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0,
                                         logprobs=1, extra_body=extra_body)
        chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0,
                                                stream=True, extra_body=extra_body))
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="other", prompt=prompt, max_tokens=2)
        with pytest.raises(openai.BadRequestError) as too_long:
            client.completions.create(model="tiny", prompt=prompt, max_tokens=1000)
    assert too_long.value.body["code"] == "invalid_request"  # type: ignore[index]
    assert "context length of 256" in too_long.value.body["detail"]  # type: ignore[index]
    choice = done.choices[0]
    extra = choice.model_extra or {}
    assert choice.finish_reason == "length" and len(extra["token_ids"]) == 12
    assert extra["prompt_token_ids"] == prompt and (done.model_extra or {})["policy_version"] == 9
    assert choice.logprobs is not None and len(choice.logprobs.token_logprobs or []) == 12
    assert done.usage is not None and done.usage.completion_tokens == 12
    streamed_ids = [i for chunk in chunks for i in (chunk.choices[0].model_extra or {}).get("token_ids", [])]
    assert streamed_ids == extra["token_ids"]
    assert "".join(chunk.choices[0].text for chunk in chunks) == choice.text
    assert chunks[-1].choices[0].finish_reason == "length" and chunks[-1].usage is not None


def test_a_closed_stream_cancels_the_generation(serve: Callable[..., str]) -> None:
    engine = ScriptedEngine.from_text("slow tokens ", pace_s=0.02)
    url = serve(engine)
    body = {"prompt": [5, 6], "max_tokens": 60, "stream": True}
    http = httpx.Client(base_url=url, timeout=10)
    with http, http.stream("POST", "/v1/completions", json=body) as reply:
        first = next(reply.iter_lines())
    assert first.startswith("data: {")
    wait_until(lambda: engine.cancelled == [engine.admitted[0].request_id])


def test_a_client_that_gives_up_cancels_the_generation(serve: Callable[..., str]) -> None:
    engine = ScriptedEngine.from_text("slow tokens ", pace_s=0.02)
    url = serve(engine)
    with httpx.Client(base_url=url, timeout=0.3) as http, pytest.raises(httpx.ReadTimeout):
        http.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 60})
    wait_until(lambda: len(engine.cancelled) == 1)
    assert engine.cancelled == [engine.admitted[0].request_id]
