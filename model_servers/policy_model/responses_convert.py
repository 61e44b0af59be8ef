"""Responses API <-> chat: request items to chat messages, a chat result to a Responses object.

Input items become chat messages in order. Consecutive assistant-side items (an assistant
``message`` and ``function_call`` items) that carry the same token capture fields (or none) are
one assistant turn: this server emits one call's output as a message item followed by its
function calls, all stamped with that call's tokens, and regroups them the same way when they
come back, so the turn keeps its exact token ids for the next prompt.
"""

from __future__ import annotations

from typing import Any

from model_servers.policy_model.generation import TOKEN_FIELDS, ChatResult
from model_servers.policy_model.ids import object_id
from model_servers.policy_model.schemas import (
    FunctionCallItem,
    FunctionCallOutputItem,
    InputItem,
    InputMessage,
    ResponsesRequest,
    ResponsesTool,
    text_of,
)

__all__ = ["chat_tools", "output_items", "request_messages", "response_object"]


def request_messages(request: ResponsesRequest) -> list[dict[str, Any]]:
    """The chat messages of a Responses request (``instructions`` first, as a system message)."""
    messages: list[dict[str, Any]] = []
    if request.instructions:
        messages.append({"role": "system", "content": request.instructions})
    if isinstance(request.input, str):
        messages.append({"role": "user", "content": request.input})
    else:
        messages.extend(_items_to_messages(request.input))
    return messages


def chat_tools(tools: list[ResponsesTool] | None) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    return [
        {"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
        for tool in tools
    ]


def _items_to_messages(items: list[InputItem]) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    turn: dict[str, Any] | None = None
    for item in items:
        if isinstance(item, FunctionCallOutputItem):
            turn = None
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": text_of(item.output)})
        elif isinstance(item, InputMessage) and item.role != "assistant":
            turn = None
            messages.append({"role": item.role, "content": text_of(item.content)})
        else:
            if turn is None or not _joins(turn, item):
                turn = _new_turn(item)
                messages.append(turn)
            _add_to_turn(turn, item)
    return messages


def _tokens_of(item: InputMessage | FunctionCallItem) -> dict[str, Any]:
    if item.prompt_token_ids is None:
        return {}
    return {name: getattr(item, name) for name in TOKEN_FIELDS}


def _new_turn(item: InputMessage | FunctionCallItem) -> dict[str, Any]:
    return {"role": "assistant", "content": None, "tool_calls": [], **_tokens_of(item)}


def _joins(turn: dict[str, Any], item: InputMessage | FunctionCallItem) -> bool:
    same_tokens = {name: turn.get(name) for name in TOKEN_FIELDS if name in turn} == _tokens_of(item)
    if isinstance(item, InputMessage):
        return same_tokens and turn["content"] is None and not turn["tool_calls"]
    return same_tokens


def _add_to_turn(turn: dict[str, Any], item: InputMessage | FunctionCallItem) -> None:
    if isinstance(item, InputMessage):
        turn["content"] = text_of(item.content)
        return
    turn["tool_calls"].append(
        {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
    )


def output_items(result: ChatResult) -> list[dict[str, Any]]:
    """One call's output: a message item (if it said anything or called nothing), then its calls."""
    tokens = result.capture.to_fields() if result.capture else {}
    status = "incomplete" if result.finish_reason == "length" else "completed"
    items: list[dict[str, Any]] = []
    if result.content or not result.tool_calls:
        items.append({
            "id": object_id("msg_", result.digest),
            "type": "message",
            "role": "assistant",
            "status": status,
            "content": [{"type": "output_text", "text": result.content, "annotations": []}],
            **tokens,
        })
    for index, call in enumerate(result.tool_calls):
        items.append({
            "id": object_id("fc_", result.digest, index),
            "type": "function_call",
            "call_id": call.id,
            "name": call.name,
            "arguments": call.arguments,
            "status": "completed",
            **tokens,
        })
    return items


def response_object(
    result: ChatResult, request: ResponsesRequest, *, model: str, created_at: int
) -> dict[str, Any]:
    """A Responses API ``response`` object for one call."""
    incomplete = result.finish_reason == "length"
    return {
        "id": object_id("resp_", result.digest),
        "object": "response",
        "created_at": created_at,
        "model": model,
        "status": "incomplete" if incomplete else "completed",
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "instructions": request.instructions,
        "metadata": request.metadata or {},
        "output": output_items(result),
        "parallel_tool_calls": True if request.parallel_tool_calls is None else request.parallel_tool_calls,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "max_output_tokens": request.max_output_tokens,
        "tool_choice": request.tool_choice or "auto",
        "tools": [tool.model_dump() for tool in request.tools or []],
        "text": {"format": {"type": "text"}},
        "truncation": "disabled",
        "previous_response_id": None,
        "reasoning": None,
        "store": False,
        "usage": {
            "input_tokens": result.prompt_tokens,
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": result.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": result.total_tokens,
        },
    }
