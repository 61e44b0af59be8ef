"""The policy participant in front of the real inference worker (embedded default model), on uvicorn.

Sampling at temperature 1 without a seed: the derived seed makes the same call of the rollout's
next attempt generate the same tokens. A streamed call and whole calls go through the custody
backend over the real mesh client, and the commit's ledger holds one row per delivered call.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest

from model_servers.inference_worker.app import create_app as create_worker_app
from model_servers.policy_model.app import create_app
from model_servers.policy_model.generation import MODEL_CALL_HEADER
from model_servers.policy_model.tests.uvicorn_server import serving
from nemo_gym_ckpt.checkpoint.router import CONTROL_PREFIX
from nemo_gym_ckpt.client import MeshClient
from nemo_gym_ckpt.config import load_config_dict
from nemo_gym_ckpt.context import ServerContext

pytestmark = pytest.mark.sockets

TOKEN = "worker-test-token"
WORKER_REF = {"type": "responses_api_models", "name": "inference_worker"}
POLICY = {"worker": WORKER_REF, "return_token_ids": True, "max_tokens": 12, "checkpoint_policy": True}
MESSAGES = [{"role": "user", "content": "What is 3 times 4?"}]


def context(name: str, root: Path, worker_port: int | None = None) -> ServerContext[Any]:
    worker: dict[str, Any] = {"torch_threads": 1} if worker_port is None else {"torch_threads": 1,
                                                                              "port": worker_port}
    mesh = load_config_dict({
        "checkpoint": {"enabled": True, "control_auth_token": TOKEN, "root": str(root)},
        "inference_worker": {"responses_api_models": {"inference_worker": worker}},
        "policy_model": {"responses_api_models": {"policy_model": POLICY}},
    })
    return ServerContext(name, mesh.instance(name).settings, mesh, MeshClient())


def client_for(port: int, capture_key: str) -> openai.AsyncOpenAI:
    url = f"http://127.0.0.1:{port}/ng-rollout/{capture_key}/v1"
    return openai.AsyncOpenAI(base_url=url, api_key="-", max_retries=0, timeout=60)


async def whole_call(port: int, capture_key: str) -> tuple[list[int], str]:
    async with client_for(port, capture_key) as client:
        raw = await client.chat.completions.with_raw_response.create(model="tiny", messages=MESSAGES)
    fields = raw.parse().choices[0].message.model_extra or {}
    return fields["generation_token_ids"], raw.headers[MODEL_CALL_HEADER]


async def streamed_call(port: int, capture_key: str) -> str:
    async with client_for(port, capture_key) as client:
        stream = await client.chat.completions.create(model="tiny", messages=MESSAGES, stream=True)
        parts = [chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices]
    return "".join(parts)


async def commit(port: int, root: Path) -> list[dict[str, Any]]:
    auth = {"authorization": f"Bearer {TOKEN}"}
    body = {"checkpoint_id": "c1", "deadline_ts": time.time() + 60}
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}{CONTROL_PREFIX}", headers=auth) as http:
        assert (await http.post("/prepare", json=body)).json()["report"]["ready"]
        reply = await http.post("/commit", json={**body, "checkpoint_dir": str(root / "c1")})
        assert reply.status_code == 200, reply.text
        await http.post("/resume", json=body)
    records_file = root / "c1" / "gym" / "model" / "policy_model" / reply.json()["manifest"]["records_file"]
    return [orjson.loads(line) for line in records_file.read_bytes().splitlines()]


async def test_sampled_calls_repeat_under_the_next_attempt_and_land_in_the_ledger(tmp_path: Path) -> None:
    async with serving(create_worker_app(context("inference_worker", tmp_path))) as worker_port:
        ctx = context("policy_model", tmp_path, worker_port)
        async with ctx.client, serving(create_app(ctx)) as port:
            first, first_id = await whole_call(port, "r1")
            assert await streamed_call(port, "r1")
            again, _ = await whole_call(port, "r1-a1")
            records = await commit(port, tmp_path)
    assert first == again
    ledgers = {record["episode_id"]["attempt"]: record["ledger"] for record in records}
    assert [row["call_id"] for row in ledgers[0]][:1] == [first_id] and len(ledgers[0]) == 2
    assert ledgers[0][1]["parent_call_id"] == first_id
    assert ledgers[1][0]["output_digest"] == ledgers[0][0]["output_digest"]
