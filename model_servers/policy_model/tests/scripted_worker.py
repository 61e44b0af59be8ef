"""A scripted inference worker: the worker's ``/v1/completions`` contract, with chosen outputs.

Each call takes the next scripted reply (``default`` once the script is empty): text to
"generate" (one id per character, or the ids scripted; the eos token appended unless the script
says the model ran on), or an error to answer. It honours ``max_tokens`` (cut, ``finish_reason: "length"``), answers
token ids, logprobs and the prompt ids, streams one SSE chunk per token, and records every request
body and rollout capture key. A reply may signal ``started`` when the call reaches the worker and
wait for ``gate`` (a generation in flight): a whole reply before it answers, a stream after its
first token (or, with ``gate_first``, before its headers).

It also serves the generation-cut route the way upstream's wire defines it (NeMo RL's worker
endpoint): it checks the request has exactly upstream's fields and digest (``upstream_digest``,
the formula written out from upstream's definition) and answers upstream's receipt, as scripted by
``cuts`` (``CutScript``): every listed ticket gets a ``durable_prefix`` of ``prefix_tokens`` tokens
(a key naming its call) unless its call is in ``refuse``; ``fail`` answers an error instead;
``gate`` holds the reply; ``tamper`` changes the receipt (a receipt that answers another
inventory). Cut and keep requests are recorded with their bearer header.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from model_servers.policy_model.chat_format import ChatFormat
from model_servers.policy_model.ids import sha256_of
from nemo_gym_ckpt.identity import current_identity
from nemo_gym_ckpt.server import create_app, sse_event

__all__ = ["GATE_S", "CutScript", "Generate", "ScriptedWorker", "WorkerFails", "staging_key", "upstream_digest"]

GATE_S = 10.0


@dataclass(frozen=True)
class Generate:
    text: str
    eos: bool = True
    token_ids: tuple[int, ...] | None = None  # these ids instead of one per character of ``text``
    error_after: int | None = None  # streaming: send this many tokens, then an error event
    started: asyncio.Event | None = None  # set when the call reaches the worker
    gate: asyncio.Event | None = None  # generation waits for it (a stream: after its first token)
    gate_first: bool = False  # a stream waits for the gate before its headers

    async def pass_gate(self) -> None:
        if self.gate is not None:
            async with asyncio.timeout(GATE_S):
                await self.gate.wait()


@dataclass(frozen=True)
class WorkerFails:
    status: int
    body: Any
    headers: dict[str, str] = field(default_factory=dict)


@dataclass
class CutScript:
    prefix_tokens: int = 5
    refuse: set[str] = field(default_factory=set)
    fail: WorkerFails | None = None
    gate: asyncio.Event | None = None
    tamper: str | None = None  # a receipt that must be refused (``_tampered`` names the ways)


def staging_key(model_call_id: str, checkpoint_id: str) -> str:
    return f"{model_call_id}.{hashlib.sha256(checkpoint_id.encode()).hexdigest()}"


def upstream_digest(checkpoint_id: str, server_name: str, prefixes: list[dict[str, Any]]) -> str:
    """Upstream's inventory digest, from its definition: SHA-256 of the compact, key-sorted JSON
    (Python's ``json``) of checkpoint id, server name and the prefixes sorted by ticket id."""
    payload = {"checkpoint_id": checkpoint_id, "server_name": server_name,
               "active_prefixes": sorted(prefixes, key=lambda prefix: prefix["ticket_id"])}
    return hashlib.sha256(json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


INVENTORY_FIELDS = {"checkpoint_id", "server_name", "active_prefixes", "inventory_digest"}
PREFIX_FIELDS = {"ticket_id", "rollout_id", "attempt", "model_call_id", "admitted_at"}


def _upstream_problem(body: dict[str, Any]) -> str | None:
    """Why ``body`` is not an upstream generation-cut inventory (``None`` when it is one)."""
    if set(body) != INVENTORY_FIELDS:
        return f"fields {sorted(body)}"
    prefixes = body["active_prefixes"]
    if any(set(prefix) != PREFIX_FIELDS or not isinstance(prefix["admitted_at"], float) for prefix in prefixes):
        return "prefix fields"
    if [prefix["ticket_id"] for prefix in prefixes] != sorted(prefix["ticket_id"] for prefix in prefixes):
        return "prefixes not sorted by ticket_id"
    if body["inventory_digest"] != upstream_digest(body["checkpoint_id"], body["server_name"], prefixes):
        return "inventory_digest"
    return None


def _ack(entry: dict[str, Any], checkpoint_id: str, script: CutScript) -> dict[str, Any]:
    if entry["model_call_id"] in script.refuse:
        return {**entry, "disposition": "durable_failure", "cut_kind": None, "frozen_buffer_id": None,
                "staging_keys": [], "prefix_token_count": None, "prefix_digest": None,
                "effective_output_limit": None, "terminal_finish_reason": None, "terminal_stop_reason": None}
    count, key = script.prefix_tokens, staging_key(entry["model_call_id"], checkpoint_id)
    return {**entry, "disposition": "durable_prefix", "cut_kind": "active_prefix", "frozen_buffer_id": f"buf-{key}",
            "staging_keys": [key], "prefix_token_count": count, "prefix_digest": sha256_of(list(range(count))),
            "effective_output_limit": 100, "terminal_finish_reason": None, "terminal_stop_reason": None}


def _tampered(receipt: dict[str, Any], how: str) -> dict[str, Any]:
    """``receipt`` changed so that upstream's ``GenerationCutReceipt`` (or its ``validate_for`` of the
    inventory sent) refuses it."""
    acks = receipt["prefixes"]
    if how == "inventory":
        return {**receipt, "inventory": {**receipt["inventory"], "server_name": "someone_else"}}
    if how == "digest":
        return {**receipt, "inventory_digest": upstream_digest("another", "policy_model", [])}
    if how == "missing_ticket":
        return {**receipt, "prefixes": acks[1:]}
    if how == "duplicate_ticket":
        return {**receipt, "prefixes": [*acks, acks[0]]}
    if how == "unknown_field":
        return {**receipt, "snapshot_path": "/tmp/elsewhere"}
    if how == "failure_with_evidence":
        return {**receipt, "prefixes": [{**ack, "disposition": "durable_failure"} for ack in acks]}
    return {**receipt, "prefixes": [{**ack, "attempt": ack["attempt"] + 1} for ack in acks]}


class ScriptedWorker:
    def __init__(self, fmt: ChatFormat, *, policy_version: int = 7) -> None:
        self.fmt = fmt
        self.policy_version = policy_version
        self.script: list[Generate | WorkerFails] = []
        self.default: Generate | None = None
        self.requests: list[dict[str, Any]] = []
        self.capture_keys: list[str | None] = []
        self.cuts = CutScript()
        self.cut_requests: list[tuple[str | None, dict[str, Any]]] = []  # (authorization, body)
        self.keep_requests: list[tuple[str | None, dict[str, Any]]] = []
        self.keep_gate: asyncio.Event | None = None  # while set to an unset event, keeps are not answered
        self._ids = itertools.count()
        self.app = self._make_app()

    def will(self, *replies: Generate | WorkerFails | str) -> ScriptedWorker:
        self.script.extend(Generate(r) if isinstance(r, str) else r for r in replies)
        return self

    def _make_app(self) -> FastAPI:
        app = create_app("scripted_worker")

        @app.post("/v1/completions", response_model=None)
        async def completions(request: Request) -> Response:
            return await self._complete(await request.json())

        @app.post("/ng-control/v1/generation-cut", response_model=None)
        async def generation_cut(request: Request) -> Response:
            return await self._cut(request.headers.get("authorization"), await request.json())

        @app.post("/ng-control/v1/generation-cut/keep")
        async def keep(request: Request) -> dict[str, Any]:
            body = await request.json()
            self.keep_requests.append((request.headers.get("authorization"), body))
            if self.keep_gate is not None:
                await self.keep_gate.wait()
            return {"kept": body["staging_keys"], "deleted": 0, "missing": []}

        return app

    async def _cut(self, authorization: str | None, body: dict[str, Any]) -> Response:
        self.cut_requests.append((authorization, body))
        script = self.cuts
        if script.gate is not None:
            async with asyncio.timeout(GATE_S):
                await script.gate.wait()
        if script.fail is not None:
            return JSONResponse(script.fail.body, status_code=script.fail.status)
        problem = _upstream_problem(body)
        if problem is not None:  # NeMo RL's worker validates the inventory with upstream's model
            return JSONResponse({"detail": f"not an upstream inventory: {problem}"}, status_code=422)
        acks = [_ack(entry, body["checkpoint_id"], script) for entry in body["active_prefixes"]]
        receipt = {"checkpoint_id": body["checkpoint_id"], "cut_id": "cut-1",
                   "inventory_digest": body["inventory_digest"], "inventory": body,
                   "backend_snapshot_id": "snapshot-1", "prefixes": acks}
        return JSONResponse(_tampered(receipt, script.tamper) if script.tamper else receipt)

    def _generation(self, reply: Generate, max_tokens: int) -> tuple[list[int], str]:
        # one id per character, tags included: the same text as a fresh encoding (which would merge
        # each tag into one id) but other ids, as a model may produce; re-tokenizing them would show
        if reply.token_ids is not None:
            ids = list(reply.token_ids)
        else:
            ids = [self.fmt.encode(char)[0] for char in reply.text]
        ids += [self.fmt.encode(self.fmt.eos_text)[0]] if reply.eos else []
        if len(ids) > max_tokens:
            return ids[:max_tokens], "length"
        return ids, "stop" if reply.eos else "length"

    async def _complete(self, body: dict[str, Any]) -> Response:
        self.requests.append(body)
        identity = current_identity()
        self.capture_keys.append(identity.capture_key if identity else None)
        reply = self.script.pop(0) if self.script or self.default is None else self.default
        if isinstance(reply, WorkerFails):
            return JSONResponse(reply.body, status_code=reply.status, headers=reply.headers)
        if reply.started is not None:
            reply.started.set()
        ids, finish = self._generation(reply, body["max_tokens"])
        logprobs = [-0.25 - index / 100 for index in range(len(ids))]
        if body.get("stream"):
            if reply.gate_first:
                await reply.pass_gate()
            chunks = self._chunks(body, ids, logprobs, finish, reply)
            return StreamingResponse(chunks, media_type="text/event-stream")
        await reply.pass_gate()
        choice = self._choice(ids, logprobs, finish, body["prompt"])
        return JSONResponse(self._envelope(choice))

    def _choice(
        self, ids: list[int], logprobs: list[float], finish: str | None, prompt: Any
    ) -> dict[str, Any]:
        choice = {
            "index": 0,
            "text": self.fmt.decode(ids).replace(self.fmt.eos_text, ""),
            "finish_reason": finish,
            "logprobs": {"tokens": [self.fmt.decode([i]) for i in ids], "token_logprobs": logprobs},
            "token_ids": ids,
            "seed": 0,
        }
        if prompt is not None:
            choice["prompt_token_ids"] = prompt
        return choice

    def _envelope(self, choice: dict[str, Any]) -> dict[str, Any]:
        return {
            "id": f"cmpl-{next(self._ids)}",
            "object": "text_completion",
            "created": 0,
            "model": "scripted",
            "choices": [choice],
            "usage": None,
            "policy_version": self.policy_version,
        }

    async def _chunks(
        self,
        body: dict[str, Any],
        ids: list[int],
        logprobs: list[float],
        finish: str,
        reply: Generate,
    ) -> AsyncIterator[bytes]:
        for index, token in enumerate(ids):
            if index == 1 and not reply.gate_first:
                await reply.pass_gate()
            if index == reply.error_after:
                yield sse_event({"error": {"code": "unavailable", "detail": "engine stopped"}})
                return
            last = index == len(ids) - 1
            prompt = body["prompt"] if index == 0 else None
            choice = self._choice([token], [logprobs[index]], finish if last else None, prompt)
            yield sse_event(self._envelope(choice))
        yield sse_event("[DONE]")
