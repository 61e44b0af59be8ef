"""The OpenAI-compatible routes: ``/v1/models``, ``/v1/chat/completions``, ``/v1/responses``.

A streamed chat completion is started before the reply begins: the backend's first event says
the call was accepted, so a refusal (bad prompt, worker down) is still a plain structured error.
A failure after the stream began is sent as an ``{"error": ...}`` event (the ``openai`` client
raises it) and the stream ends without ``[DONE]``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from fastapi import APIRouter, Response
from starlette.responses import StreamingResponse

from model_servers.policy_model.backend import Backend
from model_servers.policy_model.call_params import Defaults, chat_call, responses_call
from model_servers.policy_model.chat_api import ChatChunks, chat_completion
from model_servers.policy_model.generation import (
    MODEL_CALL_HEADER,
    ChatCall,
    ChatResult,
    StreamEvent,
    StreamStarted,
    TextDelta,
)
from model_servers.policy_model.responses_convert import response_object
from model_servers.policy_model.schemas import ChatCompletionRequest, ResponsesRequest
from nemo_gym_ckpt.errors import GymError, InternalError
from nemo_gym_ckpt.server import BoundedJsonRoute, sse_event

__all__ = ["make_router"]


def make_router(backend: Backend, defaults: Defaults) -> APIRouter:
    router = APIRouter(route_class=BoundedJsonRoute)

    @router.get("/v1/models")
    async def models() -> dict[str, Any]:
        model = {"id": backend.model_name, "object": "model", "created": 0, "owned_by": "nemo-gym-ckpt"}
        return {"object": "list", "data": [model]}

    @router.post("/v1/chat/completions", response_model=None)
    async def chat_completions(
        request: ChatCompletionRequest, response: Response
    ) -> dict[str, Any] | StreamingResponse:
        call = chat_call(request, defaults)
        if request.stream:
            include_usage = bool(request.stream_options and request.stream_options.include_usage)
            return await _stream_chat(backend, call, include_usage=include_usage)
        result = await backend.complete(call)
        response.headers.update(_call_headers(result.model_call_id))
        return chat_completion(result, model=backend.model_name, created=int(time.time()))

    @router.post("/v1/responses")
    async def responses(request: ResponsesRequest, response: Response) -> dict[str, Any]:
        result = await backend.complete(responses_call(request, defaults))
        response.headers.update(_call_headers(result.model_call_id))
        return response_object(result, request, model=backend.model_name, created_at=int(time.time()))

    return router


async def _stream_chat(backend: Backend, call: ChatCall, *, include_usage: bool) -> StreamingResponse:
    events = backend.stream(call)
    first = await anext(events)
    if not isinstance(first, StreamStarted):
        await events.aclose()
        raise InternalError(f"the backend's stream began with {type(first).__name__}, not StreamStarted")
    chunks = ChatChunks(digest=first.digest, model=backend.model_name, created=int(time.time()))
    return StreamingResponse(
        _chat_events(events, chunks, include_usage),
        media_type="text/event-stream",
        headers=_call_headers(first.model_call_id),
    )


def _call_headers(model_call_id: str | None) -> dict[str, str]:
    """The model call's id in the capture ledger, when the call has one (checkpointing on)."""
    return {MODEL_CALL_HEADER: model_call_id} if model_call_id else {}


async def _chat_events(
    events: AsyncGenerator[StreamEvent, None], chunks: ChatChunks, include_usage: bool
) -> AsyncIterator[bytes]:
    async with contextlib.aclosing(events):
        yield sse_event(chunks.role())
        try:
            async for event in events:
                if isinstance(event, TextDelta):
                    yield sse_event(chunks.content(event.text))
                elif isinstance(event, ChatResult):
                    for chunk in _closing_chunks(chunks, event, include_usage):
                        yield sse_event(chunk)
        except GymError as error:
            yield sse_event(_error_event(error))
            return
    yield sse_event("[DONE]")


def _closing_chunks(chunks: ChatChunks, result: ChatResult, include_usage: bool) -> list[dict[str, Any]]:
    closing = [chunks.tool_calls(result)] if result.tool_calls else []
    closing.append(chunks.finish(result))
    if include_usage:
        closing.append(chunks.usage(result))
    return closing


def _error_event(error: GymError) -> dict[str, Any]:
    """Our error body, plus the ``message`` key the ``openai`` client reads from a stream error."""
    body = error.to_body()
    body["error"]["message"] = error.detail
    return body
