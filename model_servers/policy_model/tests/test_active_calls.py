"""``conversation_digest``: what matches a re-issued call to its cut after a restore."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest

from model_servers.policy_model.active_calls import conversation_digest
from model_servers.policy_model.generation import TOKEN_FIELDS, ChatCall, Sampling

pytestmark = pytest.mark.unit

TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
TOKENS = {"prompt_token_ids": [5, 6, 7], "generation_token_ids": [8, 9], "generation_log_probs": [-0.25, -1.5],
          "policy_version": 3}


def conversation(*, tokens: bool) -> list[dict[str, Any]]:
    """A user question, a tool call and its result, a text answer, another question (the call's
    assistant turns carry the token fields the server returned, or not, as a restored agent's)."""
    capture = TOKENS if tokens else {}
    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}
    return [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "1 + 2?"},
        {"role": "assistant", "content": None, "tool_calls": [call], **capture},
        {"role": "tool", "tool_call_id": "call_1", "content": "3"},
        {"role": "assistant", "content": "3", **{**capture, "generation_token_ids": [10]}},
        {"role": "user", "content": "and 2 + 2?"},
    ]


def digest(messages: list[dict[str, Any]], tools: Any = TOOLS, tool_choice: Any = "auto") -> str:
    return conversation_digest(ChatCall(messages, tools, Sampling(1.0, 1.0, 64), tool_choice=tool_choice))


def test_a_conversation_matches_itself_without_its_token_fields() -> None:
    with_tokens, without = conversation(tokens=True), conversation(tokens=False)
    assert any(key in message for message in with_tokens for key in TOKEN_FIELDS)
    assert digest(with_tokens) == digest(without)
    # some turns carrying arrays (put back after a restore) and others not match too
    mixed = conversation(tokens=False)
    mixed[2].update(TOKENS)
    assert digest(mixed) == digest(without)


def _edit(index: int, key: str, value: Any) -> Callable[[list[dict[str, Any]]], None]:
    def apply(messages: list[dict[str, Any]]) -> None:
        messages[index][key] = value
    return apply


def _rename_tool(messages: list[dict[str, Any]]) -> None:
    messages[2]["tool_calls"][0]["function"]["arguments"] = '{"a": 2, "b": 1}'


EDITS: dict[str, Callable[[list[dict[str, Any]]], object]] = {
    "text": _edit(4, "content", "three"),
    "role": _edit(1, "role", "developer"),
    "tool call id": _edit(3, "tool_call_id", "call_2"),
    "tool call arguments": _rename_tool,
    "another key": _edit(1, "name", "alice"),
    "order": lambda messages: messages.insert(0, messages.pop(1)),
    "a dropped turn": lambda messages: messages.pop(0),
}


@pytest.mark.parametrize("edit", sorted(EDITS))
def test_anything_but_the_token_fields_changes_the_digest(edit: str) -> None:
    changed = copy.deepcopy(conversation(tokens=False))
    EDITS[edit](changed)
    assert digest(changed) != digest(conversation(tokens=True))


def test_tools_and_tool_choice_change_the_digest() -> None:
    messages = conversation(tokens=False)
    assert digest(messages, tools=None) != digest(messages)
    assert digest(messages, tool_choice="none") != digest(messages)
