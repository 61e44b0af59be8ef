"""A worker that holds all the completions it may refuses a call up front (429
``capacity_exceeded``, nothing started there): the policy model sends the same request again after
``Retry-After`` within the call's deadline, so a rollout's call is not failed for the refusal."""

from __future__ import annotations

import pytest

from model_servers.policy_model.tests.conftest import PolicyClient
from model_servers.policy_model.tests.scripted_worker import ScriptedWorker, WorkerFails
from model_servers.policy_model.tests.test_chat_route import sse_payloads

pytestmark = pytest.mark.unit

USER = {"role": "user", "content": "hi"}
FULL = WorkerFails(429, {"error": {"code": "capacity_exceeded", "detail": "the worker holds 65 completions"}})


async def test_a_refused_call_is_sent_again_and_answered(policy_client: PolicyClient, worker: ScriptedWorker) -> None:
    worker.will(FULL, "hello")
    async with policy_client() as http:
        reply = await http.post("/ng-rollout/r1-a1/v1/chat/completions", json={"messages": [USER]})
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["message"]["content"] == "hello"
    assert len(worker.requests) == 2 and worker.requests[0] == worker.requests[1]
    assert worker.capture_keys == ["r1-a1", "r1-a1"]


async def test_a_refused_stream_is_opened_again(policy_client: PolicyClient, worker: ScriptedWorker) -> None:
    worker.will(FULL, "hello")
    async with policy_client() as http:
        reply = await http.post("/v1/chat/completions", json={"messages": [USER], "stream": True})
    assert reply.status_code == 200, reply.text
    chunks = sse_payloads(reply.text)[:-1]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == "hello"
    assert len(worker.requests) == 2 and worker.requests[0] == worker.requests[1]


async def test_refusals_past_the_call_deadline_are_the_callers_refusal(
    policy_client: PolicyClient, worker: ScriptedWorker
) -> None:
    full_for_2_s = WorkerFails(FULL.status, FULL.body, {"retry-after": "2"})
    worker.will(full_for_2_s, full_for_2_s, "never")
    # room for one wait of 2 s, not two: the first refusal may come up to 1.5 s late (a loaded machine)
    async with policy_client(request_timeout_s=3.5) as http:
        reply = await http.post("/v1/chat/completions", json={"messages": [USER]})
    assert reply.status_code == 429 and reply.json()["error"]["code"] == "capacity_exceeded"
    assert reply.headers["retry-after"] == "2" and len(worker.requests) == 2
