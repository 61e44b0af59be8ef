"""Small rules about OpenAI Responses API payloads that agents and environments share.

- an ``input`` given as a string is one user message;
- ``usage`` objects add up field by field, nested details included, across model calls or
  agent activations;
- the answer of a trajectory is the text of its last ``message`` item.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["add_usage", "last_message_text", "normalize_input"]


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


def last_message_text(output: Sequence[Mapping[str, Any]]) -> str | None:
    """The text of the last ``message`` output item (its ``output_text`` parts), or None."""
    for item in reversed(output):
        if item.get("type") == "message":
            return _message_text(item.get("content"))
    return None


def _message_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return ""
    return "".join(_part_text(part) for part in content)


def _part_text(part: Any) -> str:
    if isinstance(part, dict) and part.get("type") in ("output_text", "text"):
        text = part.get("text")
        return text if isinstance(text, str) else ""
    return ""
