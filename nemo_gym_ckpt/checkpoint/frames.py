"""The frames of a server's worker channel: a 4-byte big-endian length, then one compact JSON object.

A multi-worker server's workers and its coordinator (``checkpoint/channel.py``) talk in these
frames over a Unix socket. ``encode_frame`` refuses a message over ``max_bytes`` before anything is
written; ``read_frame`` refuses a length over ``max_bytes`` before reading the body, a body that does
not arrive within ``FRAME_BODY_S`` of its header (a peer stalled inside a frame), a body that is not
a JSON object, and a stream that ends inside a frame. Every refusal is
``InvalidCheckpointState`` (422: the peer sent something unusable), so the channel closes with a
structured reason instead of a hang or unbounded memory. A stream that ends between frames is a
clean end (``None``).
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Mapping
from typing import Any

import orjson

from nemo_gym_ckpt.errors import InvalidCheckpointState

__all__ = ["FRAME_BODY_S", "HEADER_BYTES", "MAX_FRAME_BYTES", "encode_frame", "read_frame"]

MAX_FRAME_BYTES = 256 * 1024 * 1024
FRAME_BODY_S = 30.0  # a frame's body, once its header is read, arrives within this (read when used)
_HEADER = struct.Struct(">I")
HEADER_BYTES = _HEADER.size


def encode_frame(message: Mapping[str, Any], max_bytes: int = MAX_FRAME_BYTES) -> bytes:
    """The frame of ``message``; ``InvalidCheckpointState`` when its JSON is over ``max_bytes``."""
    try:
        body = orjson.dumps(message)
    except TypeError as error:
        raise InvalidCheckpointState(f"a worker message is not JSON: {error}") from None
    if len(body) > max_bytes:
        raise InvalidCheckpointState(f"a worker message of {len(body)} bytes is over the {max_bytes}-byte bound")
    return _HEADER.pack(len(body)) + body


async def read_frame(
    reader: asyncio.StreamReader, max_bytes: int = MAX_FRAME_BYTES, body_s: float | None = None
) -> dict[str, Any] | None:
    """The next message, or ``None`` when the stream ended between frames. Waiting for a frame is
    unbounded (a quiet peer is no fault); its body must come within ``body_s`` (``FRAME_BODY_S``)."""
    try:
        header = await reader.readexactly(HEADER_BYTES)
    except asyncio.IncompleteReadError as error:
        if not error.partial:
            return None
        raise InvalidCheckpointState("the worker channel ended inside a frame header") from None
    (size,) = _HEADER.unpack(header)
    if size > max_bytes:
        raise InvalidCheckpointState(f"a frame of {size} bytes is over the {max_bytes}-byte bound")
    body_s = FRAME_BODY_S if body_s is None else body_s
    try:
        async with asyncio.timeout(body_s):
            body = await reader.readexactly(size)
    except asyncio.IncompleteReadError:
        raise InvalidCheckpointState(f"the worker channel ended inside a frame of {size} bytes") from None
    except TimeoutError:
        raise InvalidCheckpointState(f"a frame of {size} bytes did not come within {body_s:g} s") from None
    try:
        message = orjson.loads(body)
    except orjson.JSONDecodeError as error:
        raise InvalidCheckpointState(f"a frame is not JSON: {error}") from None
    if not isinstance(message, dict):
        raise InvalidCheckpointState(f"a frame holds a JSON {type(message).__name__}, not an object")
    return message
