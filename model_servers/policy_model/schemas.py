"""Request bodies of ``/v1/chat/completions`` and ``/v1/responses``.

The top-level bodies refuse unknown fields (an OpenAI server answers 400 to an unrecognised
argument, and a typo must not silently change sampling). Messages, items and content parts
ignore unknown fields, because clients echo back whole objects they were given (``refusal``,
``annotations``...). Token capture fields may ride on assistant messages (chat) and on output
items passed back (Responses): ``prompt_token_ids`` and ``generation_token_ids`` come together.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator

from nemo_gym_ckpt.bounds import (
    MAX_ITEMS,
    MAX_TOKENS,
    Id,
    LogProb,
    Name,
    PolicyVersion,
    Seed,
    Text,
    TokenId,
    TokenLimit,
)

__all__ = [
    "ChatCompletionRequest",
    "ChatMessage",
    "ChatTool",
    "FunctionCallItem",
    "FunctionCallOutputItem",
    "FunctionSpec",
    "InputItem",
    "InputMessage",
    "ResponsesRequest",
    "ResponsesTool",
    "TextPart",
    "TokenFields",
    "text_of",
]

ToolChoice = Literal["auto", "none", "required"] | dict[str, Any]
Temperature = Annotated[float, Field(ge=0.0, le=2.0)]
TopP = Annotated[float, Field(gt=0.0, le=1.0)]
PositiveInt = TokenLimit
Choices = Annotated[int, Field(ge=1, le=128)]
TokenIds = Annotated[list[TokenId], Field(max_length=MAX_TOKENS)]
LogProbs = Annotated[list[LogProb], Field(max_length=MAX_TOKENS)]
Stop = Name | Annotated[list[Name], Field(max_length=16)]
Metadata = Annotated[dict[Name, Annotated[str, Field(max_length=4096)]], Field(max_length=64)]
_FUNCTION_NAME = r"^[A-Za-z0-9_.:-]{1,64}$"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TokenFields(BaseModel):
    """The four token capture fields; prompt and generation ids come together or not at all."""

    prompt_token_ids: TokenIds | None = None
    generation_token_ids: TokenIds | None = None
    generation_log_probs: LogProbs | None = None
    policy_version: PolicyVersion | None = None

    @model_validator(mode="after")
    def _ids_together(self) -> TokenFields:
        if (self.prompt_token_ids is None) != (self.generation_token_ids is None):
            raise ValueError("prompt_token_ids and generation_token_ids must be given together")
        return self


class TextPart(_Lenient):
    type: Literal["text", "input_text", "output_text"]
    text: Text


Content = Text | Annotated[list[TextPart], Field(max_length=MAX_ITEMS)]


def text_of(content: Content | None) -> str | None:
    """Content flattened to one string (parts joined without separators)."""
    if content is None or isinstance(content, str):
        return content
    return "".join(part.text for part in content)


class FunctionSpec(_Lenient):
    name: str = Field(pattern=_FUNCTION_NAME, max_length=64)
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(_Lenient):
    type: Literal["function"]
    function: FunctionSpec


class _CalledFunction(_Lenient):
    name: Name
    arguments: Text


class MessageToolCall(_Lenient):
    id: Id
    type: Literal["function"] = "function"
    function: _CalledFunction


class ChatMessage(TokenFields, _Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Content | None = None
    name: Name | None = None
    tool_calls: Annotated[list[MessageToolCall], Field(max_length=1024)] | None = None
    tool_call_id: Id | None = None

    @model_validator(mode="after")
    def _content_where_needed(self) -> ChatMessage:
        if self.role != "assistant" and self.content is None:
            raise ValueError(f"a {self.role} message needs content")
        if self.role != "assistant" and self.prompt_token_ids is not None:
            raise ValueError("token ids are only accepted on assistant messages")
        return self


class StreamOptions(_Lenient):
    include_usage: bool = False


class ChatCompletionRequest(_Strict):
    model: Name | None = None
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_ITEMS)
    tools: Annotated[list[ChatTool], Field(max_length=1024)] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    max_tokens: PositiveInt | None = None
    max_completion_tokens: PositiveInt | None = None
    seed: Seed | None = None
    stop: Stop | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Choices | None = None
    return_token_ids: bool | None = None
    user: Name | None = None
    metadata: Metadata | None = None
    store: bool | None = None


class ResponsesTool(_Lenient):
    type: Literal["function"]
    name: str = Field(pattern=_FUNCTION_NAME, max_length=64)
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class InputMessage(TokenFields, _Lenient):
    type: Literal["message"] = "message"
    role: Literal["system", "developer", "user", "assistant"]
    content: Content
    id: Id | None = None

    @model_validator(mode="after")
    def _tokens_on_assistant_only(self) -> InputMessage:
        if self.role != "assistant" and self.prompt_token_ids is not None:
            raise ValueError("token ids are only accepted on assistant messages")
        return self


class FunctionCallItem(TokenFields, _Lenient):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1, max_length=512)
    name: Name
    arguments: Text
    id: Id | None = None


class FunctionCallOutputItem(_Lenient):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1, max_length=512)
    output: Content


def _item_kind(value: Any) -> str | None:
    if isinstance(value, dict):
        kind = value.get("type", "message")
        return kind if isinstance(kind, str) else None
    return getattr(value, "type", None)


InputItem = Annotated[
    Annotated[InputMessage, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")],
    Discriminator(_item_kind),
]


class ResponsesRequest(_Strict):
    model: Name | None = None
    input: Text | Annotated[list[InputItem], Field(max_length=MAX_ITEMS)]
    instructions: Text | None = None
    tools: Annotated[list[ResponsesTool], Field(max_length=1024)] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    max_output_tokens: PositiveInt | None = None
    seed: Seed | None = None
    stream: bool | None = None
    return_token_ids: bool | None = None
    metadata: Metadata | None = None
    store: bool | None = None
    user: Name | None = None
    truncation: Literal["disabled"] | None = None
    previous_response_id: None = None
