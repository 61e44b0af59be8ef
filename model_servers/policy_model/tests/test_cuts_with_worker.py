"""Generation cuts over real sockets: the policy model and the real inference worker on uvicorn.

A long call (sampled with an explicit seed) is cut by a commit while it generates, goes on and ends
exactly as an uninterrupted call with the same seed; then fresh servers (the same checkpoint root
and staging directory) restore, and the re-issued call continues from the staged prefix to the
same tokens, generating only what came after the cut.
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
from model_servers.inference_worker.tests.cut_helpers import staged_line
from model_servers.policy_model.app import create_app
from model_servers.policy_model.tests.uvicorn_server import serving
from nemo_gym_ckpt.bench.cuts import PROMPT
from nemo_gym_ckpt.checkpoint.router import CONTROL_PREFIX
from nemo_gym_ckpt.client import MeshClient
from nemo_gym_ckpt.config import load_config_dict
from nemo_gym_ckpt.context import ServerContext

pytestmark = [pytest.mark.sockets, pytest.mark.timeout(240)]

TOKEN = "cuts-socket-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}
WORKER_REF = {"type": "responses_api_models", "name": "inference_worker"}
POLICY = {"worker": WORKER_REF, "return_token_ids": True, "max_tokens": 160, "checkpoint_policy": True,
          "generation_cuts": True}
BODY = {"model": "tiny", "messages": [{"role": "user", "content": PROMPT}], "seed": 11}
CUT_AFTER = 32
WAIT_S = 60.0


def context(name: str, root: Path, worker_port: int | None = None) -> ServerContext[Any]:
    worker: dict[str, Any] = {"torch_threads": 1, "staging_dir": str(root / "staging")}
    if worker_port is not None:
        worker["port"] = worker_port
    mesh = load_config_dict({
        "checkpoint": {"enabled": True, "control_auth_token": TOKEN, "root": str(root)},
        "inference_worker": {"responses_api_models": {"inference_worker": worker}},
        "policy_model": {"responses_api_models": {"policy_model": POLICY}},
    })
    return ServerContext(name, mesh.instance(name).settings, mesh, MeshClient())


@asynccontextmanager
async def servers(root: Path) -> AsyncIterator[tuple[httpx.AsyncClient, httpx.AsyncClient]]:
    """A worker and a policy model on uvicorn; clients to (policy, worker)."""
    async with serving(create_worker_app(context("inference_worker", root))) as worker_port:
        ctx = context("policy_model", root, worker_port)
        async with ctx.client, serving(create_app(ctx)) as port, httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{port}", timeout=WAIT_S
        ) as policy, httpx.AsyncClient(base_url=f"http://127.0.0.1:{worker_port}", timeout=WAIT_S) as worker:
            yield policy, worker


async def chat(policy: httpx.AsyncClient, capture_key: str) -> dict[str, Any]:
    reply = await policy.post(f"/ng-rollout/{capture_key}/v1/chat/completions", json=BODY)
    assert reply.status_code == 200, reply.text
    message: dict[str, Any] = reply.json()["choices"][0]["message"]
    return message


async def worker_status(worker: httpx.AsyncClient) -> dict[str, Any]:
    reply = await worker.get("/ng-control/v1/generation-cut/status", headers=AUTH)
    assert reply.status_code == 200, reply.text
    status: dict[str, Any] = reply.json()
    return status


async def until_generating(worker: httpx.AsyncClient, capture_key: str, tokens: int) -> None:
    deadline = time.monotonic() + WAIT_S
    while True:
        live = {g["capture_key"]: g["tokens"] for g in (await worker_status(worker))["live_generations"]}
        if live.get(capture_key, 0) >= tokens:
            return
        assert time.monotonic() < deadline, f"{capture_key} never reached {tokens} tokens: {live}"
        await asyncio.sleep(0.002)


async def control(policy: httpx.AsyncClient, op: str, **body: Any) -> dict[str, Any]:
    body = {"deadline_ts": time.time() + WAIT_S, **body}
    reply = await policy.post(f"{CONTROL_PREFIX}/{op}", json=body, headers=AUTH)
    assert reply.status_code == 200, f"{op}: {reply.text}"
    result: dict[str, Any] = reply.json()
    return result


async def test_a_cut_call_goes_on_unchanged_and_continues_after_a_restore(tmp_path: Path) -> None:
    scope = [{"rollout_id": "r1", "attempt": 0}]
    async with servers(tmp_path) as (policy, worker):
        uninterrupted = await chat(policy, "ref")
        running = asyncio.ensure_future(chat(policy, "r1"))
        await until_generating(worker, "r1", CUT_AFTER)
        assert (await control(policy, "prepare", checkpoint_id="c1"))["report"]["ready"]
        committed = await control(policy, "commit", checkpoint_id="c1", checkpoint_dir=str(tmp_path / "c1"),
                                  episode_ids=scope)
        await control(policy, "resume", checkpoint_id="c1")
        cut_run = await asyncio.wait_for(running, WAIT_S)
    async with servers(tmp_path) as (policy, worker):
        directory = str(tmp_path / "c1")
        await control(policy, "restore", checkpoint_id="c1", checkpoint_dir=directory, episode_ids=scope)
        await control(policy, "resume", checkpoint_id="c1")
        continued = await chat(policy, "r1-a1")
        counters = await worker_status(worker)
    [key] = committed["staging_keys"]
    kept = counters["tokens_from_staging"]
    length = len(uninterrupted["generation_token_ids"])
    assert cut_run["generation_token_ids"] == uninterrupted["generation_token_ids"]
    assert continued["generation_token_ids"] == uninterrupted["generation_token_ids"]
    assert continued["generation_log_probs"] == pytest.approx(uninterrupted["generation_log_probs"], abs=1e-4)
    assert staged_line(tmp_path / "staging", key) and CUT_AFTER <= kept < length
    assert counters["tokens_generated"] == length - kept  # nothing before the cut was generated again
