"""Deterministic ids, digests and seeds derived from what a call saw and produced.

A completion, a tool call and a Responses item get ids from a digest of the call's prompt and
generation, never from a random source: a rollout that is restored and generates the same tokens
again gets the same ids, so its output matches an uninterrupted run.

``sha256_of`` is the digest the capture ledger records (prompt, output and conversation digests):
SHA-256 of the compact JSON with sorted keys, so token ids ``[1, 2, 3]`` hash the bytes
``[1,2,3]``; anyone holding the ids can check it. ``call_seed`` is the sampling seed of a
rollout-scoped call that came without one: a pure function of the rollout id and the prompt
digest, so a call made again by the next attempt of the rollout samples with the same seed.
"""

from __future__ import annotations

import hashlib
from typing import Any

from nemo_gym_ckpt.canonical import canonical_json, sha256_of

__all__ = ["SEED_BITS", "call_seed", "digest_of", "object_id", "sha256_of"]

_ID_HEX = 24
SEED_BITS = 63


def digest_of(*parts: Any) -> str:
    """A hex digest of JSON-serialisable parts (order matters)."""
    return hashlib.blake2b(canonical_json(parts), digest_size=16).hexdigest()


def object_id(prefix: str, digest: str, index: int | None = None) -> str:
    """``call_<hex>``, ``fc_<hex>``, ``msg_<hex>``... of one call (``index`` for several per call)."""
    if index is None:
        return f"{prefix}{digest[:_ID_HEX]}"
    return f"{prefix}{digest_of(digest, index)[:_ID_HEX]}"


def call_seed(rollout_id: str, prompt_digest: str) -> int:
    """The seed of a rollout's call that came without one: non-negative, below ``2**63``."""
    data = f"ng-call-seed:v1:{rollout_id}:{prompt_digest}".encode()
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "big") >> (64 - SEED_BITS)
