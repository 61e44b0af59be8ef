"""vLLM's ``/v1/chat/completions`` on the worker: the request, its completion, and the reply shapes.

A chat is rendered with the engine tokenizer's chat template and tokenized (``chat_prompt``: the
ids of earlier turns are kept when the request names them), then generated exactly as a
``/v1/completions`` of those prompt ids (``ChatCompletionRequest.completion``): the same sampling,
stop handling, generation-cut tracking and streaming. ``ChatView`` turns the finished
``CompletionBuilder`` into vLLM's reply:

- ``choices[0].message``: ``content``, and with tools offered (``tool_choice`` absent or ``auto``)
  the Hermes ``<tool_call>{json}</tool_call>`` blocks parsed into ``tool_calls`` the way our policy
  model parses them (``finish_reason`` ``tool_calls`` then);
- ``logprobs: true`` (``top_logprobs`` 0; more are not implemented): ``choices[0].logprobs.content``
  with one ``{token, logprob, bytes, top_logprobs: []}`` per generated token; ``token`` is
  ``token_id:<id>`` with ``return_tokens_as_token_ids``;
- ``return_token_ids``: top-level ``prompt_token_ids`` and ``choices[0].token_ids`` (the stop token
  included, as vLLM does);
- ``usage`` and our ``policy_version``.

Streaming sends a first chunk with the role (and ``prompt_token_ids``), then content, logprobs and
token id deltas; with tools offered the content is held until the end, where the parsed tool calls go
in the finishing chunk; ``stream_options.include_usage`` adds a usage chunk; then ``[DONE]``.
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from model_servers.inference_worker.chat_messages import (
    MAX_MESSAGES,
    MAX_TOOLS,
    ChatMessage,
    ChatTool,
    TokenIds,
    template_request,
)
from model_servers.inference_worker.chat_prompt import ChatPrompt
from model_servers.inference_worker.completions import (
    IGNORED_FIELDS,
    NEUTRAL_VALUES,
    CompletionBuilder,
    CompletionRequest,
    StopTexts,
    StopTokenIds,
    StreamOptions,
)
from model_servers.inference_worker.engine import ChatTemplateRequest
from model_servers.policy_model.tool_calls import parse_turn
from nemo_gym_ckpt.bounds import Name, Seed, TokenLimit
from nemo_gym_ckpt.errors import InvalidRequest

__all__ = ["ChatCompletionRequest", "ChatView"]

#: Chat fields accepted and ignored, beyond those of completions.
CHAT_IGNORED_FIELDS = IGNORED_FIELDS | {"parallel_tool_calls", "include_reasoning", "session_id"}
#: Chat fields accepted only at their no-op values, beyond those of completions.
CHAT_NEUTRAL_VALUES: dict[str, tuple[Any, ...]] = {
    **NEUTRAL_VALUES,
    "chat_template": (None,),
    "mm_processor_kwargs": (None, {}),
    "media_io_kwargs": (None, {}),
    "documents": (None, []),
    "functions": (None, []),
    "function_call": (None,),
    "prediction": (None,),
    "modalities": (None, ["text"]),
    "reasoning_effort": (None,),
}
#: vLLM writes a logprob that is not finite as this.
FLOOR_LOGPROB = -9999.0


class ChatCompletionRequest(BaseModel):
    """The body of ``POST /v1/chat/completions`` (vLLM's fields that change what is generated)."""

    model_config = ConfigDict(extra="allow")

    model: Name | None = None
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    tools: list[ChatTool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["auto", "none", "required"] | dict[str, Any] | None = None
    max_tokens: TokenLimit | None = None
    max_completion_tokens: TokenLimit | None = None
    temperature: float | None = Field(None, ge=0, le=1e6, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0, le=1, allow_inf_nan=False)
    seed: Seed | None = None
    stop: StopTexts | None = None
    stop_token_ids: StopTokenIds | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(1, ge=1, le=128)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    return_tokens_as_token_ids: bool | None = None
    return_token_ids: bool | None = None
    skip_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    #: NeMo Gym's ``vllm_model`` extension (``supply_prefix_token_ids``): the prompt starts with these.
    required_prefix_token_ids: TokenIds | None = None

    def check_fields(self) -> None:
        """400 on fields this worker does not implement (any value that would change the output)."""
        for name, value in (self.model_extra or {}).items():
            if name in CHAT_IGNORED_FIELDS:
                continue
            if name not in CHAT_NEUTRAL_VALUES:
                raise InvalidRequest(f"unknown field {name!r}")
            if value not in CHAT_NEUTRAL_VALUES[name]:
                raise InvalidRequest(f"field {name!r}={value!r} is not supported by this worker")
        if self.top_logprobs:
            raise InvalidRequest(f"top_logprobs={self.top_logprobs} is not supported: top-k logprobs are not "
                                 "implemented; use 0 for the sampled token's logprob")
        if self.tool_choice not in (None, "auto", "none"):
            raise InvalidRequest(f"tool_choice {self.tool_choice!r} is not supported: only 'auto' and 'none' "
                                 "(forcing a tool needs constrained decoding)")

    def template(self) -> ChatTemplateRequest:
        return template_request(
            self.tools, add_generation_prompt=self.add_generation_prompt,
            continue_final_message=self.continue_final_message, chat_template_kwargs=self.chat_template_kwargs,
        )

    @property
    def parses_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice in (None, "auto")

    def completion(self, prompt: ChatPrompt) -> CompletionRequest:
        """The completion of the rendered prompt that this chat generates."""
        return CompletionRequest(
            model=self.model, prompt=prompt.ids, max_tokens=self.max_completion_tokens or self.max_tokens,
            temperature=self.temperature, top_p=self.top_p, seed=self.seed, stop=self.stop,
            stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos, stream=self.stream,
            logprobs=0 if self.logprobs else None, return_token_ids=True, n=self.n,
            return_tokens_as_token_ids=self.return_tokens_as_token_ids,
            skip_special_tokens=self.skip_special_tokens,
        )


def _logprob(value: float) -> float:
    return value if math.isfinite(value) else FLOOR_LOGPROB


def _logprob_entries(tokens: list[str], logprobs: list[float]) -> list[dict[str, Any]]:
    return [
        {"token": token, "logprob": _logprob(logprob), "bytes": list(token.encode("utf-8")), "top_logprobs": []}
        for token, logprob in zip(tokens, logprobs, strict=True)
    ]


@dataclass
class _Turn:
    content: str | None
    tool_calls: list[dict[str, Any]]


@dataclass
class ChatView:
    """Renders one chat completion from the ``CompletionBuilder`` that generated it."""

    request: ChatCompletionRequest
    prompt: ChatPrompt
    id: str = field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex}")
    created: int = field(default_factory=lambda: int(time.time()))
    _sent_tokens: int = 0

    def _turn(self, text: str) -> _Turn:
        if not self.request.parses_tools:
            return _Turn(text, [])
        parsed = parse_turn(text)
        calls = [
            {"id": f"chatcmpl-tool-{uuid.uuid4().hex}", "type": "function",
             "function": {"name": call.name, "arguments": call.arguments}}
            for call in parsed.calls
        ]
        return _Turn(parsed.content if parsed.content or not calls else None, calls)

    def _finish_reason(self, builder: CompletionBuilder, turn: _Turn) -> str | None:
        if builder.finish_reason == "stop" and turn.tool_calls:
            return "tool_calls"
        return builder.finish_reason

    def _logprobs(self, builder: CompletionBuilder, start: int) -> dict[str, Any] | None:
        if not self.request.logprobs:
            return None
        return {"content": _logprob_entries(builder.token_strings(start), builder.token_logprobs[start:])}

    def _envelope(self, builder: CompletionBuilder, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": builder.served_model,
                "choices": choices, "policy_version": builder.policy_version}

    def response(self, builder: CompletionBuilder) -> dict[str, Any]:
        """The whole (non-streaming) reply."""
        turn = self._turn(builder.text)
        message: dict[str, Any] = {"role": "assistant", "content": turn.content}
        if turn.tool_calls:
            message["tool_calls"] = turn.tool_calls
        choice: dict[str, Any] = {
            "index": 0, "message": message, "logprobs": self._logprobs(builder, 0),
            "finish_reason": self._finish_reason(builder, turn), "stop_reason": builder.stop_reason,
        }
        body = self._envelope(builder, "chat.completion", [choice])
        if self.request.return_token_ids:
            choice["token_ids"] = list(builder.token_ids)
            body["prompt_token_ids"] = list(self.prompt.ids)
        body["usage"] = builder.usage()
        return body

    # ---- streaming -------------------------------------------------------------------------------

    def first_chunk(self, builder: CompletionBuilder) -> dict[str, Any]:
        choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                  "finish_reason": None}
        chunk = self._envelope(builder, "chat.completion.chunk", [choice])
        if self.request.return_token_ids:
            chunk["prompt_token_ids"] = list(self.prompt.ids)
        return chunk

    def chunk(self, builder: CompletionBuilder) -> dict[str, Any] | None:
        """The next chunk (the text and tokens new since the last one), or None if nothing is new."""
        piece = builder.chunk()
        if piece is None:
            return None
        start, self._sent_tokens = self._sent_tokens, len(builder.token_ids)
        finished = builder.finish_reason is not None
        delta: dict[str, Any] = {}
        finish_reason = None
        if not self.request.parses_tools:
            delta["content"] = piece["choices"][0]["text"]
            finish_reason = builder.finish_reason
        elif finished:
            turn = self._turn(builder.text)
            delta["content"] = turn.content
            if turn.tool_calls:
                delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(turn.tool_calls)]
            finish_reason = self._finish_reason(builder, turn)
        choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": self._logprobs(builder, start),
                                  "finish_reason": finish_reason}
        if finished:
            choice["stop_reason"] = builder.stop_reason
        if self.request.return_token_ids:
            choice["token_ids"] = builder.token_ids[start:]
        return self._envelope(builder, "chat.completion.chunk", [choice])

    def usage_chunk(self, builder: CompletionBuilder) -> dict[str, Any] | None:
        options = self.request.stream_options
        if options is None or not options.include_usage:
            return None
        chunk = self._envelope(builder, "chat.completion.chunk", [])
        chunk["usage"] = builder.usage()
        return chunk
