"""Chat messages as vLLM's OpenAI server takes them, and what the chat template is given.

``ChatMessage`` is one message of ``/v1/chat/completions`` or of the chat form of ``/tokenize``:
a role, text content (a string or a list of text parts; other part types are refused), and for
assistant turns tool calls, reasoning, and the token capture fields NeMo Gym's ``vllm_model`` sends
back on history (``prompt_token_ids``, ``generation_token_ids``, ``generation_log_probs``). Unknown
keys on a message are ignored, as vLLM ignores them. Every list and string is bounded.

``template_messages`` is what the template renders: content parts joined with newlines (vLLM's
``string`` content format), the token fields left out, a tool call's JSON ``arguments`` string
parsed into an object (as vLLM hands them to Hugging Face templates). ``TemplateKwargs`` checks
``chat_template_kwargs``: at most 32 keys, none that the renderer sets itself, 64 KiB of JSON; the
tools given to the template are at most 1 MiB of JSON.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictStr, field_validator, model_validator

from model_servers.inference_worker.engine import ChatTemplateRequest
from nemo_gym_ckpt.bounds import LogProb, TokenId
from nemo_gym_ckpt.errors import InvalidRequest

__all__ = [
    "MAX_MESSAGES",
    "MAX_TOKEN_IDS",
    "ChatMessage",
    "ChatTool",
    "TokenIds",
    "known_ids",
    "template_messages",
    "template_request",
]

MAX_MESSAGES = 4096
MAX_TEXT = 4_000_000  # characters of one string
MAX_PARTS = 1024
MAX_TOOLS = 512
MAX_TOKEN_IDS = 1 << 20
MAX_KWARGS = 32
MAX_KWARGS_BYTES = 64 * 1024
MAX_TOOLS_BYTES = 1 << 20
#: Keyword arguments the renderer passes itself; a template kwarg may not override them.
RESERVED_KWARGS = frozenset({"conversation", "messages", "tools", "documents", "tokenize", "add_generation_prompt",
                             "continue_final_message", "chat_template", "return_dict", "return_tensors",
                             "padding", "truncation", "max_length", "tokenizer_kwargs"})

Text = Annotated[StrictStr, Field(max_length=MAX_TEXT)]
TokenIds = Annotated[list[TokenId], Field(max_length=MAX_TOKEN_IDS)]


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TextPart(_Lenient):
    type: Literal["text", "input_text", "output_text"]
    text: Text


class _Part(_Lenient):
    type: StrictStr = Field(max_length=64)


class _CalledFunction(_Lenient):
    name: Annotated[StrictStr, Field(max_length=256)]
    arguments: Text | dict[str, Any]


class ToolCall(_Lenient):
    id: Annotated[StrictStr, Field(max_length=256)] | None = None
    type: Literal["function"] = "function"
    function: _CalledFunction


class FunctionSpec(_Lenient):
    name: Annotated[StrictStr, Field(min_length=1, max_length=256)]
    description: Text | None = None
    parameters: dict[str, Any] | None = None


class ChatTool(_Lenient):
    type: Literal["function"] = "function"
    function: FunctionSpec


class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | Annotated[list[TextPart | _Part], Field(max_length=MAX_PARTS)] | None = None
    name: Annotated[StrictStr, Field(max_length=256)] | None = None
    tool_calls: Annotated[list[ToolCall], Field(max_length=MAX_TOOLS)] | None = None
    tool_call_id: Annotated[StrictStr, Field(max_length=256)] | None = None
    reasoning_content: Text | None = None
    reasoning: Text | None = None
    prompt_token_ids: TokenIds | None = None
    generation_token_ids: TokenIds | None = None
    generation_log_probs: Annotated[list[LogProb], Field(max_length=MAX_TOKEN_IDS)] | None = None

    @field_validator("content")
    @classmethod
    def _text_only(cls, content: Any) -> Any:
        if isinstance(content, list):
            other = next((part.type for part in content if not isinstance(part, TextPart)), None)
            if other is not None:
                raise ValueError(f"content part of type {other!r} is not supported: text only")
        return content

    @model_validator(mode="after")
    def _token_ids_together(self) -> ChatMessage:
        if (self.prompt_token_ids is None) != (self.generation_token_ids is None):
            raise ValueError("prompt_token_ids and generation_token_ids come together")
        if self.prompt_token_ids is not None and self.role != "assistant":
            raise ValueError("token ids are only accepted on assistant messages")
        return self


def _text(content: str | list[Any] | None) -> str | None:
    if content is None or isinstance(content, str):
        return content
    return "\n".join(part.text for part in content)


def _arguments(arguments: str | dict[str, Any]) -> Any:
    if isinstance(arguments, dict):
        return arguments
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments  # not JSON: the template gets the model's text as it was


def _template_message(message: ChatMessage) -> dict[str, Any]:
    rendered: dict[str, Any] = {"role": message.role, "content": _text(message.content)}
    for key in ("name", "tool_call_id", "reasoning_content", "reasoning"):
        value = getattr(message, key)
        if value is not None:
            rendered[key] = value
    if message.tool_calls:
        rendered["tool_calls"] = [
            {"id": call.id, "type": "function",
             "function": {"name": call.function.name, "arguments": _arguments(call.function.arguments)}}
            for call in message.tool_calls
        ]
    return rendered


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The messages as the chat template renders them (no token fields)."""
    return [_template_message(message) for message in messages]


def _checked_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any]:
    if not kwargs:
        return {}
    if len(kwargs) > MAX_KWARGS:
        raise InvalidRequest(f"chat_template_kwargs holds {len(kwargs)} keys; at most {MAX_KWARGS}")
    reserved = sorted(RESERVED_KWARGS.intersection(kwargs))
    if reserved:
        raise InvalidRequest(f"chat_template_kwargs may not set {reserved}: the request's own fields do")
    if len(json.dumps(kwargs)) > MAX_KWARGS_BYTES:
        raise InvalidRequest(f"chat_template_kwargs is larger than {MAX_KWARGS_BYTES} bytes of JSON")
    return dict(kwargs)


def template_request(
    tools: list[ChatTool] | None, *, add_generation_prompt: bool, continue_final_message: bool,
    chat_template_kwargs: dict[str, Any] | None,
) -> ChatTemplateRequest:
    """The rendering options of a request, checked (vLLM refuses both prompt flags together)."""
    if add_generation_prompt and continue_final_message:
        raise InvalidRequest("continue_final_message and add_generation_prompt cannot both be true")
    specs = [tool.model_dump(exclude_none=True) for tool in tools] if tools else None
    if specs and len(json.dumps(specs)) > MAX_TOOLS_BYTES:
        raise InvalidRequest(f"tools are larger than {MAX_TOOLS_BYTES} bytes of JSON")
    return ChatTemplateRequest(
        tools=specs,
        add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
        template_kwargs=_checked_kwargs(chat_template_kwargs),
    )


def known_ids(messages: list[ChatMessage]) -> list[int] | None:
    """Prompt + generation ids of the last assistant turn that carries them (NeMo Gym's history)."""
    for message in reversed(messages):
        if message.role == "assistant" and message.prompt_token_ids is not None:
            assert message.generation_token_ids is not None
            return [*message.prompt_token_ids, *message.generation_token_ids]
    return None
