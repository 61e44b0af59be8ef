"""Chat Completions reply shapes: the ``chat.completion`` object and its streamed chunks.

Token capture fields sit on ``choices[0].message`` (and, when streaming, on the ``delta`` of the
chunk that carries ``finish_reason``). Tool calls are streamed whole in one delta at the end.
"""

from __future__ import annotations

from typing import Any

from model_servers.policy_model.generation import ChatResult
from model_servers.policy_model.ids import object_id

__all__ = ["ChatChunks", "chat_completion", "chat_usage"]


def chat_usage(result: ChatResult) -> dict[str, int]:
    return {
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": result.completion_tokens,
        "total_tokens": result.total_tokens,
    }


def _message(result: ChatResult) -> dict[str, Any]:
    message: dict[str, Any] = {
        "role": "assistant",
        "content": None if (result.tool_calls and not result.content) else result.content,
    }
    if result.tool_calls:
        message["tool_calls"] = [call.to_chat() for call in result.tool_calls]
    if result.capture is not None:
        message.update(result.capture.to_fields())
    return message


def chat_completion(result: ChatResult, *, model: str, created: int) -> dict[str, Any]:
    return {
        "id": object_id("chatcmpl-", result.digest),
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {"index": 0, "message": _message(result), "finish_reason": result.finish_reason, "logprobs": None}
        ],
        "usage": chat_usage(result),
    }


class ChatChunks:
    """Builds the ``chat.completion.chunk`` objects of one streamed completion."""

    def __init__(self, *, digest: str, model: str, created: int) -> None:
        self._head = {
            "id": object_id("chatcmpl-", digest),
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
        }

    def _chunk(self, delta: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
        choice = {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
        return {**self._head, "choices": [choice]}

    def role(self) -> dict[str, Any]:
        return self._chunk({"role": "assistant", "content": ""})

    def content(self, text: str) -> dict[str, Any]:
        return self._chunk({"content": text})

    def tool_calls(self, result: ChatResult) -> dict[str, Any]:
        calls = [{"index": index, **call.to_chat()} for index, call in enumerate(result.tool_calls)]
        return self._chunk({"tool_calls": calls})

    def finish(self, result: ChatResult) -> dict[str, Any]:
        delta = result.capture.to_fields() if result.capture is not None else {}
        return self._chunk(delta, result.finish_reason)

    def usage(self, result: ChatResult) -> dict[str, Any]:
        return {**self._head, "choices": [], "usage": chat_usage(result)}
