"""Deterministic object ids derived from what a call saw and produced.

A completion, a tool call and a Responses item get ids from a digest of the call's prompt and
generation, never from a random source: a rollout that is restored and generates the same tokens
again gets the same ids, so its output matches an uninterrupted run.
"""

from __future__ import annotations

import hashlib
from typing import Any

import orjson

__all__ = ["digest_of", "object_id"]

_ID_HEX = 24


def digest_of(*parts: Any) -> str:
    """A hex digest of JSON-serialisable parts (order matters)."""
    data = orjson.dumps(parts, option=orjson.OPT_SORT_KEYS)
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def object_id(prefix: str, digest: str, index: int | None = None) -> str:
    """``call_<hex>``, ``fc_<hex>``, ``msg_<hex>``... of one call (``index`` for several per call)."""
    if index is None:
        return f"{prefix}{digest[:_ID_HEX]}"
    return f"{prefix}{digest_of(digest, index)[:_ID_HEX]}"
