"""Canonical JSON: the one byte form that digests are taken over.

Sorted keys, no whitespace, UTF-8 (orjson). Task digests, request digests, config digests and the
inference worker's cut digests all hash these bytes, so the same data always gives the same digest
on every server.
"""

from __future__ import annotations

import hashlib
from typing import Any

import orjson

__all__ = ["canonical_json", "sha256_of"]


def canonical_json(value: Any) -> bytes:
    """Sorted keys, no whitespace, UTF-8: the same data always gives the same bytes."""
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS)


def sha256_of(value: Any) -> str:
    """Hex SHA-256 of the canonical JSON of ``value``."""
    return hashlib.sha256(canonical_json(value)).hexdigest()
