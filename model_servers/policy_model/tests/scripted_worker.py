"""A scripted inference worker: the worker's ``/v1/completions`` contract, with chosen outputs.

Each call takes the next scripted reply (``default`` once the script is empty): text to
"generate" (one id per character, the eos token appended unless the script says the model ran
on), or an error to answer. It honours ``max_tokens`` (cut, ``finish_reason: "length"``), answers
token ids, logprobs and the prompt ids, streams one SSE chunk per token, and records every request
body and rollout capture key. A reply may signal ``started`` when the call reaches the worker and
wait for ``gate`` (a generation in flight): a whole reply before it answers, a stream after its
first token (or, with ``gate_first``, before its headers).

It also serves the worker's generation-cut routes as scripted by ``cuts`` (``CutScript``): every
listed ticket gets a ``durable_prefix`` of ``prefix_tokens`` tokens (a key naming its call) unless
its call is in ``refuse``; ``fail`` answers an error instead; ``gate`` holds the reply. Cut and
keep requests are recorded with their bearer header.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from model_servers.policy_model.chat_format import ChatFormat
from model_servers.policy_model.ids import sha256_of
from nemo_gym_ckpt.identity import current_identity
from nemo_gym_ckpt.server import create_app, sse_event

__all__ = ["GATE_S", "CutScript", "Generate", "ScriptedWorker", "WorkerFails", "staging_key"]

GATE_S = 10.0


@dataclass(frozen=True)
class Generate:
    text: str
    eos: bool = True
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


@dataclass
class CutScript:
    prefix_tokens: int = 5
    refuse: set[str] = field(default_factory=set)
    fail: WorkerFails | None = None
    gate: asyncio.Event | None = None


def staging_key(model_call_id: str, checkpoint_id: str) -> str:
    return f"{model_call_id}.{hashlib.sha256(checkpoint_id.encode()).hexdigest()}"


def _receipt(entry: dict[str, Any], checkpoint_id: str, script: CutScript) -> dict[str, Any]:
    if entry["model_call_id"] in script.refuse:
        return {"ticket_id": entry["ticket_id"], "model_call_id": entry["model_call_id"],
                "disposition": "durable_failure", "cut_kind": None, "staging_keys": [],
                "prefix_token_count": 0, "prefix_digest": None, "effective_output_limit": None,
                "terminal_finish_reason": None, "detail": "refused by the script"}
    count = script.prefix_tokens
    return {"ticket_id": entry["ticket_id"], "model_call_id": entry["model_call_id"],
            "disposition": "durable_prefix", "cut_kind": "active_prefix",
            "staging_keys": [staging_key(entry["model_call_id"], checkpoint_id)], "prefix_token_count": count,
            "prefix_digest": sha256_of(list(range(count))), "effective_output_limit": 100 - count,
            "terminal_finish_reason": None, "detail": None}


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
        receipts = [_receipt(entry, body["checkpoint_id"], script) for entry in body["active_prefixes"]]
        return JSONResponse({"cut_id": "cut-1", "checkpoint_id": body["checkpoint_id"], "receipts": receipts})

    def _generation(self, reply: Generate, max_tokens: int) -> tuple[list[int], str]:
        # one id per character, tags included: the same text as a fresh encoding (which would merge
        # each tag into one id) but other ids, as a model may produce; re-tokenizing them would show
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
            return JSONResponse(reply.body, status_code=reply.status)
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
