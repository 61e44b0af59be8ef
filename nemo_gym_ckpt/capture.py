"""Token capture: the field names training reads token arrays under, written once.

A model call's output item (Responses API) or assistant message (Chat Completions) carries the
three arrays of ``TOKEN_ARRAYS`` and the ``POLICY_VERSION`` of the weights that made them, under
NeMo Gym's names. An engine's completion choice carries its own two arrays
(``ENGINE_TOKEN_ARRAYS``: ``token_ids`` and ``logprobs``, as vLLM names them). Checkpoint records
never carry any of them (``RECORD_FORBIDDEN_KEYS``; docs/protocol.md section 6): token arrays live
in the policy model's token sidecar.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "CAPTURE_FIELDS",
    "ENGINE_TOKEN_ARRAYS",
    "GENERATION_LOG_PROBS",
    "GENERATION_TOKEN_IDS",
    "POLICY_VERSION",
    "PROMPT_TOKEN_IDS",
    "RECORD_FORBIDDEN_KEYS",
    "TOKEN_ARRAYS",
    "without_token_arrays",
]

PROMPT_TOKEN_IDS = "prompt_token_ids"
GENERATION_TOKEN_IDS = "generation_token_ids"
GENERATION_LOG_PROBS = "generation_log_probs"
POLICY_VERSION = "policy_version"

TOKEN_ARRAYS = (PROMPT_TOKEN_IDS, GENERATION_TOKEN_IDS, GENERATION_LOG_PROBS)
"""The three arrays of one model call, in the order they are written on an item."""
CAPTURE_FIELDS = (*TOKEN_ARRAYS, POLICY_VERSION)
"""Everything token capture adds to an item or message."""
ENGINE_TOKEN_ARRAYS = ("token_ids", "logprobs")
"""The arrays of an engine's completion choice."""
RECORD_FORBIDDEN_KEYS = (*TOKEN_ARRAYS, *ENGINE_TOKEN_ARRAYS)
"""Keys a checkpoint record may not carry at any depth."""

_FORBIDDEN = frozenset(RECORD_FORBIDDEN_KEYS)


def without_token_arrays(value: Any) -> Any:
    """A copy of JSON data without the token-array keys at any depth (what a record may carry)."""
    if isinstance(value, dict):
        return {key: without_token_arrays(item) for key, item in value.items() if key not in _FORBIDDEN}
    if isinstance(value, list):
        return [without_token_arrays(item) for item in value]
    return value
