"""Small rules about OpenAI Responses API payloads that agents and environments share.

- an ``input`` given as a string is one user message;
- ``usage`` objects add up field by field, nested details included, across model calls or
  agent activations.
"""

from __future__ import annotations

from typing import Any

__all__ = ["add_usage", "normalize_input"]


def normalize_input(value: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A string input is one user message; a list passes as a (shallow) copy."""
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    return list(value)


def add_usage(total: Any, more: Any) -> Any:
    """Sum two usage objects field by field; a missing side (None) counts as nothing."""
    if more is None:
        return total
    if total is None:
        return more
    if isinstance(total, dict) and isinstance(more, dict):
        return {key: add_usage(total.get(key), more.get(key)) for key in {**total, **more}}
    if _is_number(total) and _is_number(more):
        return total + more
    return more


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
