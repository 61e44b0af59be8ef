"""Canonical JSON: the one byte form that digests are taken over.

Sorted keys, no whitespace, UTF-8 (orjson). Task digests, request digests, config digests and the
inference worker's cut digests all hash these bytes, so the same data always gives the same digest
on every server.

orjson writes at most ``MAX_JSON_LEVELS`` levels of nesting (it reads 1,024), so a value read from
JSON may be one no server can write again, and one that can be written may stop being writable once
something wraps it (a record wraps an episode's state in two more levels). ``nested`` wraps a value
in that many one-item lists, which adds exactly that many levels and nothing else: encoding it
checks, in the same one pass, that the value can still be written that much deeper.
"""

from __future__ import annotations

import hashlib
from typing import Any

import orjson

__all__ = ["MAX_JSON_LEVELS", "canonical_json", "canonical_json_within", "nested", "sha256_of"]

MAX_JSON_LEVELS = 254
"""Levels of nesting orjson writes; a value nested deeper raises ``orjson.JSONEncodeError``."""


def canonical_json(value: Any) -> bytes:
    """Sorted keys, no whitespace, UTF-8: the same data always gives the same bytes."""
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS)


def sha256_of(value: Any) -> str:
    """Hex SHA-256 of the canonical JSON of ``value``."""
    return hashlib.sha256(canonical_json(value)).hexdigest()


def nested(value: Any, levels: int) -> Any:
    """``value`` inside ``levels`` one-item lists: exactly ``levels`` levels deeper, nothing else added."""
    for _ in range(levels):
        value = [value]
    return value


def canonical_json_within(value: Any, levels: int) -> bytes:
    """``canonical_json(value)``, in one pass that also checks that ``value`` can be written ``levels``
    levels deeper (``orjson.JSONEncodeError`` otherwise): a list of one item is ``[`` + item + ``]``."""
    if levels == 0:
        return canonical_json(value)
    return canonical_json(nested(value, levels))[levels:-levels]
