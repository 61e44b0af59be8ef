"""Helpers of the generation-cut tests: bodies, a gate around any engine, and bounded waits.

``GatedEngine`` wraps any ``Engine`` (the scripted one, or the real transformers engine) behind
the same interface and lets a test decide how many tokens reach the worker's HTTP layer, so a cut
lands at a chosen token boundary. Waits poll the worker's cut status (a state, never an ordering)
and every one has a deadline.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

import httpx
import orjson

from model_servers.inference_worker.engine import Engine, EngineTokenizer, GenerationRequest, TokenStep
from model_servers.inference_worker.tests.conftest import TOKEN

__all__ = [
    "AUTH",
    "GatedEngine",
    "batch_files",
    "batch_of",
    "complete_under",
    "cut",
    "cut_body",
    "model_call",
    "staged_line",
    "start_under",
    "status",
    "until_tokens",
    "upstream_digest",
]

AUTH = {"authorization": f"Bearer {TOKEN}"}
WAIT_S = 30.0


def batch_files(root: Path) -> list[Path]:
    """The staging store's batch files (one per cut request that staged something)."""
    return sorted(root.glob("cut-*.jsonl"))


def batch_of(root: Path, key: str) -> Path:
    """The batch file whose header lists ``key``."""
    for path in batch_files(root):
        if key in orjson.loads(path.read_bytes().split(b"\n", 1)[0])["keys"]:
            return path
    raise AssertionError(f"no batch file lists {key}")


def staged_line(root: Path, key: str) -> bytes:
    """The line of ``key`` in its batch file (the prefix's JSON)."""
    path = batch_of(root, key)
    lines = path.read_bytes().split(b"\n")
    number: int = orjson.loads(lines[0])["keys"].index(key) + 1
    return lines[number]


def model_call(call_id: str, parent: str | None = None, previous_length: int = 0,
               constrained: bool = False) -> dict[str, Any]:
    return {"model_call_id": call_id, "parent_call_id": parent, "previous_length": previous_length,
            "constrained": constrained}


def upstream_digest(checkpoint_id: str, server_name: str, prefixes: list[dict[str, Any]]) -> str:
    """Upstream's inventory digest, written out here from its definition (NeMo Gym's
    ``GenerationCutInventory.build``): SHA-256 of the compact, key-sorted JSON (Python's ``json``) of
    the checkpoint id, the server name and the prefixes sorted by ticket id."""
    payload = {"checkpoint_id": checkpoint_id, "server_name": server_name,
               "active_prefixes": sorted(prefixes, key=lambda prefix: prefix["ticket_id"])}
    return hashlib.sha256(json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def cut_body(
    checkpoint_id: str, *entries: tuple[str, str, int, str], server: str = "policy_model"
) -> dict[str, Any]:
    """An upstream-shaped cut request of ``(ticket_id, rollout_id, attempt, model_call_id)`` entries
    (prefixes sorted by ticket id, as upstream's requester sends them)."""
    prefixes = sorted(({"ticket_id": t, "rollout_id": r, "attempt": a, "model_call_id": c, "admitted_at": 1.5}
                       for t, r, a, c in entries), key=lambda prefix: prefix["ticket_id"])
    return {"checkpoint_id": checkpoint_id, "server_name": server, "active_prefixes": prefixes,
            "inventory_digest": upstream_digest(checkpoint_id, server, prefixes)}


async def cut(http: httpx.AsyncClient, body: dict[str, Any]) -> dict[str, Any]:
    reply = await http.post("/ng-control/v1/generation-cut", json=body, headers=AUTH)
    assert reply.status_code == 200, reply.text
    result: dict[str, Any] = reply.json()
    return result


async def status(http: httpx.AsyncClient) -> dict[str, Any]:
    reply = await http.get("/ng-control/v1/generation-cut/status", headers=AUTH)
    assert reply.status_code == 200, reply.text
    result: dict[str, Any] = reply.json()
    return result


async def until_tokens(http: httpx.AsyncClient, call_id: str, tokens: int) -> None:
    """Until the worker's live generation ``call_id`` holds ``tokens`` tokens (bounded)."""
    deadline = time.monotonic() + WAIT_S
    while True:
        live = {g["model_call_id"]: g["tokens"] for g in (await status(http))["live_generations"]}
        if live.get(call_id) == tokens:
            return
        assert time.monotonic() < deadline, f"{call_id} never reached {tokens} tokens: {live}"
        await asyncio.sleep(0.005)


def start_under(
    http: httpx.AsyncClient, capture_key: str, body: dict[str, Any]
) -> asyncio.Task[httpx.Response]:
    return asyncio.ensure_future(http.post(f"/ng-rollout/{capture_key}/v1/completions", json=body))


async def complete_under(http: httpx.AsyncClient, capture_key: str, body: dict[str, Any]) -> httpx.Response:
    async with asyncio.timeout(WAIT_S):
        return await start_under(http, capture_key, body)


class GatedEngine(Engine):
    """``inner`` behind the engine interface; each token waits for the gate while it is closed.

    With ``apart`` each generation waits on a gate of its own (``release_nth``), so a test decides
    which generation a token goes to; otherwise all share one gate and a token goes to whichever
    generation asks first.
    """

    def __init__(self, inner: Engine, *, apart: bool = False) -> None:
        super().__init__(policy_version=inner.policy_version)
        self.inner = inner
        self.gate = asyncio.Semaphore(0)
        self.apart = apart
        self.own_gates: list[asyncio.Semaphore] = []
        self.open = False
        self.admitted: list[GenerationRequest] = []

    @property
    def tokenizer(self) -> EngineTokenizer:
        return self.inner.tokenizer

    @property
    def context_length(self) -> int:
        return self.inner.context_length

    async def start(self) -> None:
        await self.inner.start()

    async def aclose(self) -> None:
        await self.inner.aclose()

    def release(self, tokens: int) -> None:
        for _ in range(tokens):
            self.gate.release()

    def release_nth(self, index: int, tokens: int) -> None:
        """Let ``tokens`` more tokens of the ``index``-th admitted generation through (``apart``)."""
        for _ in range(tokens):
            self.own_gates[index].release()

    async def until_admitted(self, count: int) -> None:
        """Until ``count`` generations reached the engine (bounded)."""
        async with asyncio.timeout(WAIT_S):
            while len(self.admitted) < count:
                await asyncio.sleep(0.005)

    def open_gate(self) -> None:
        """Let every further token through."""
        self.open = True
        self.release(1_000_000)
        for gate in self.own_gates:
            gate.release()  # the one token a waiting generation asks for; the next ones pass open

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[TokenStep, None]:
        gate = self.gate
        if self.apart:
            gate = asyncio.Semaphore(0)
            self.own_gates.append(gate)
        self.admitted.append(request)
        steps = self.inner.generate(request)
        try:
            async for step in steps:
                if not self.open:
                    async with asyncio.timeout(WAIT_S):
                        await gate.acquire()
                yield step
        finally:
            await steps.aclose()
