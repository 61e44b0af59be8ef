"""From a chat or Responses request to one ``ChatCall``: server defaults and what we refuse.

Refused with 400: ``n`` other than 1, a forced tool choice (``"required"`` or a named function:
that needs constrained decoding, which is not implemented), streaming Responses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from model_servers.policy_model.generation import TOKEN_FIELDS, ChatCall, Sampling
from model_servers.policy_model.responses_convert import chat_tools, request_messages
from model_servers.policy_model.schemas import ChatCompletionRequest, ChatMessage, ResponsesRequest, text_of
from nemo_gym_ckpt.errors import InvalidRequest

__all__ = ["Defaults", "chat_call", "responses_call"]


@dataclass(frozen=True)
class Defaults:
    """The server's settings for what a request leaves out."""

    temperature: float
    top_p: float
    max_tokens: int
    return_token_ids: bool


def _tool_choice(choice: Any) -> Literal["auto", "none"]:
    if choice is None or choice == "auto":
        return "auto"
    if choice == "none":
        return "none"
    raise InvalidRequest(f"tool_choice {choice!r} is not supported: only 'auto' and 'none' (forcing a tool "
                         "needs constrained decoding, which this server does not implement)")


def _stop(stop: str | list[str] | None) -> tuple[str, ...]:
    strings = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if any(not s for s in strings):
        raise InvalidRequest("stop strings must not be empty")
    return strings


def _want_tokens(asked: bool | None, defaults: Defaults) -> bool:
    return defaults.return_token_ids if asked is None else asked


def _message_dict(message: ChatMessage) -> dict[str, Any]:
    result: dict[str, Any] = {"role": message.role, "content": text_of(message.content)}
    if message.name is not None:
        result["name"] = message.name
    if message.tool_calls:
        result["tool_calls"] = [
            call.model_dump(include={"id", "type", "function"}) for call in message.tool_calls
        ]
    if message.tool_call_id is not None:
        result["tool_call_id"] = message.tool_call_id
    if message.prompt_token_ids is not None:
        result.update({name: getattr(message, name) for name in TOKEN_FIELDS})
    return result


def chat_call(request: ChatCompletionRequest, defaults: Defaults) -> ChatCall:
    if request.n not in (None, 1):
        raise InvalidRequest(f"n={request.n} is not supported: one choice per request")
    max_tokens = request.max_completion_tokens or request.max_tokens or defaults.max_tokens
    sampling = Sampling(
        temperature=defaults.temperature if request.temperature is None else request.temperature,
        top_p=defaults.top_p if request.top_p is None else request.top_p,
        max_tokens=max_tokens,
        seed=request.seed,
        stop=_stop(request.stop),
    )
    tools = [tool.model_dump(exclude_none=True) for tool in request.tools] if request.tools else None
    return ChatCall(
        messages=[_message_dict(message) for message in request.messages],
        tools=tools,
        sampling=sampling,
        tool_choice=_tool_choice(request.tool_choice),
        want_tokens=_want_tokens(request.return_token_ids, defaults),
    )


def responses_call(request: ResponsesRequest, defaults: Defaults) -> ChatCall:
    if request.stream:
        raise InvalidRequest("streaming is not supported on /v1/responses; use /v1/chat/completions "
                             "with stream")
    messages = request_messages(request)
    if not messages:
        raise InvalidRequest("input holds no message")
    sampling = Sampling(
        temperature=defaults.temperature if request.temperature is None else request.temperature,
        top_p=defaults.top_p if request.top_p is None else request.top_p,
        max_tokens=request.max_output_tokens or defaults.max_tokens,
        seed=request.seed,
    )
    return ChatCall(
        messages=messages,
        tools=chat_tools(request.tools),
        sampling=sampling,
        tool_choice=_tool_choice(request.tool_choice),
        want_tokens=_want_tokens(request.return_token_ids, defaults),
    )
