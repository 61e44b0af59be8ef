"""Reading a peer's server-sent events (``data: {json}`` lines ending with ``data: [DONE]``).

Every line is awaited under the caller's overall deadline, so a stalled stream ends in
``UpstreamTimeout`` rather than hanging. An event carrying ``{"error": ...}`` is raised as the
matching ``GymError``; a stream that stops without ``[DONE]`` is an ``UpstreamError``.

The response is one that ``MeshClient.stream`` opened: its body is bounded there, below the lines
read here (``max_stream_line_bytes`` a line, ``max_reply_bytes`` in all, the call's deadline), so a
worker that never ends a line or a stream fails the call with the client's ``UpstreamError`` or
``UpstreamTimeout`` before it can grow memory without limit.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson

from nemo_gym_ckpt.errors import UpstreamError, UpstreamTimeout, error_from_body

__all__ = ["read_sse_json"]

_DATA = "data:"
_DONE = "[DONE]"


async def read_sse_json(response: httpx.Response, deadline: float) -> AsyncIterator[dict[str, Any]]:
    """The JSON objects of ``response``'s events until ``[DONE]``; ``deadline`` is loop time.
    ``response`` comes from ``MeshClient.stream``, which bounds each line and the whole body."""
    lines = response.aiter_lines()
    while True:
        try:
            async with asyncio.timeout_at(deadline):
                line = await anext(lines)
        except StopAsyncIteration:
            raise UpstreamError(f"{response.request.url} ended its stream without [DONE]") from None
        except TimeoutError:
            raise UpstreamTimeout(f"{response.request.url} stream ran past its deadline") from None
        if not line.startswith(_DATA):
            continue
        payload = line[len(_DATA) :].strip()
        if payload == _DONE:
            return
        yield _event(payload, response)


def _event(payload: str, response: httpx.Response) -> dict[str, Any]:
    try:
        event = orjson.loads(payload)
    except orjson.JSONDecodeError:
        raise UpstreamError(f"{response.request.url} streamed an event that is not JSON") from None
    if not isinstance(event, dict):
        raise UpstreamError(f"{response.request.url} streamed an event that is not an object")
    if "error" in event:
        raise error_from_body(502, event)
    return event
