"""Hermes-style tool-call parsing of an assistant turn's text.

Each ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` block becomes one call; the
text outside the blocks, kept exactly (whitespace included), is the message content. A block
whose JSON is malformed (or is not an object with a string ``name`` and object ``arguments``) is
not a call: its raw text stays in the content, so nothing the model wrote is lost. An unclosed
``<tool_call>`` (a turn cut by ``max_tokens``) is plain content too.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

__all__ = ["TOOL_CALL_CLOSE", "TOOL_CALL_OPEN", "ParsedCall", "ParsedTurn", "parse_turn"]

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
_BLOCK = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)" + re.escape(TOOL_CALL_CLOSE), re.DOTALL)


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # compact JSON of an object, key order as the model wrote it


@dataclass(frozen=True)
class ParsedTurn:
    content: str
    calls: list[ParsedCall]


def parse_turn(text: str) -> ParsedTurn:
    """Split ``text`` into content and tool calls."""
    calls: list[ParsedCall] = []
    pieces: list[str] = []
    position = 0
    for block in _BLOCK.finditer(text):
        call = _parse_block(block.group(1))
        if call is None:
            continue
        pieces.append(text[position : block.start()])
        position = block.end()
        calls.append(call)
    pieces.append(text[position:])
    return ParsedTurn("".join(pieces), calls)


def _parse_block(body: str) -> ParsedCall | None:
    try:
        data: Any = json.loads(body)
    except ValueError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str) or not data["name"]:
        return None
    arguments = data.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ParsedCall(data["name"], json.dumps(arguments, separators=(",", ":"), ensure_ascii=False))
