"""What the upstream mode reads from an OpenAI-compatible (vLLM) server, and the token ids in it.

Replies of ``/v1/chat/completions``, ``/v1/completions``, ``/tokenize`` and ``/detokenize``, checked
with pydantic (an unusable reply is a 502 ``upstream_error``). Token ids of a chat completion are
found where NeMo Gym's ``vllm_model`` looks for them, first match wins:

1. a NeMo RL style bundle on the message (``prompt_token_ids`` + ``generation_token_ids`` +
   ``generation_log_probs``);
2. vLLM's ``return_token_ids``: top-level (or the choice's) ``prompt_token_ids`` and the choice's
   ``token_ids``, with the logprobs of ``logprobs.content`` (checked against ``token_id:<id>`` tokens
   when vLLM wrote them so);
3. vLLM's ``return_tokens_as_token_ids``: ``logprobs.content[].token`` as ``token_id:<id>``; the prompt
   ids then come from ``/tokenize`` (the caller passes them).

A completion's ids are its ``token_ids``, or its ``logprobs.tokens`` as ``token_id:<id>``.
"""

from __future__ import annotations

from typing import TypeVar

import httpx
from pydantic import BaseModel, NonNegativeInt, ValidationError

from model_servers.policy_model.generation import TokenCapture
from nemo_gym_ckpt.errors import UpstreamError

__all__ = [
    "ChatChoice",
    "ChatReply",
    "CompletionChoice",
    "CompletionReply",
    "DetokenizeReply",
    "TokenizeReply",
    "Usage",
    "chat_capture",
    "completion_ids",
    "parsed",
]

TOKEN_ID_PREFIX = "token_id:"

Reply = TypeVar("Reply", bound=BaseModel)


class _Function(BaseModel):
    name: str
    arguments: str


class ToolCallOut(BaseModel):
    id: str | None = None
    function: _Function


class ChatMessageOut(BaseModel):
    content: str | None = None
    tool_calls: list[ToolCallOut] | None = None
    prompt_token_ids: list[NonNegativeInt] | None = None
    generation_token_ids: list[NonNegativeInt] | None = None
    generation_log_probs: list[float] | None = None
    policy_version: int | str | None = None


class _ContentLogprob(BaseModel):
    token: str | None = None
    logprob: float


class _ChatLogprobs(BaseModel):
    content: list[_ContentLogprob] | None = None


class ChatChoice(BaseModel):
    message: ChatMessageOut
    finish_reason: str | None = None
    logprobs: _ChatLogprobs | None = None
    token_ids: list[NonNegativeInt] | None = None
    prompt_token_ids: list[NonNegativeInt] | None = None


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0


class ChatReply(BaseModel):
    choices: list[ChatChoice]
    usage: Usage | None = None
    prompt_token_ids: list[NonNegativeInt] | None = None
    policy_version: int | str | None = None

    @property
    def version(self) -> int | str | None:
        message = self.choices[0].message
        return message.policy_version if message.policy_version is not None else self.policy_version


class _CompletionLogprobs(BaseModel):
    tokens: list[str] | None = None
    token_logprobs: list[float | None]


class CompletionChoice(BaseModel):
    text: str = ""
    finish_reason: str | None = None
    logprobs: _CompletionLogprobs | None = None
    token_ids: list[NonNegativeInt] | None = None
    prompt_token_ids: list[NonNegativeInt] | None = None


class CompletionReply(BaseModel):
    choices: list[CompletionChoice]
    policy_version: int | str | None = None


class TokenizeReply(BaseModel):
    tokens: list[NonNegativeInt]


class DetokenizeReply(BaseModel):
    prompt: str


def parsed(model: type[Reply], response: httpx.Response, what: str) -> Reply:
    """``response``'s JSON as ``model``; one choice where the reply has choices."""
    try:
        reply = model.model_validate_json(response.content)
    except ValidationError as error:
        detail = f"the upstream model server answered an unusable {what}: {error.errors()[0]}"
        raise UpstreamError(detail) from None
    choices = getattr(reply, "choices", None)
    if choices is not None and len(choices) != 1:
        raise UpstreamError(f"the upstream model server answered {len(choices)} choices, expected 1")
    return reply


def _token_id(token: str | None) -> int | None:
    if token is None or not token.startswith(TOKEN_ID_PREFIX):
        return None
    try:
        value = int(token.removeprefix(TOKEN_ID_PREFIX))
    except ValueError:
        return None
    return value if value >= 0 else None


def _ids_of_tokens(tokens: list[str | None]) -> list[int] | None:
    """The ids of ``token_id:<id>`` strings; None unless every token is one."""
    ids = [_token_id(token) for token in tokens]
    return None if any(i is None for i in ids) else [i for i in ids if i is not None]


def _checked(prompt: list[int], generation: list[int], logprobs: list[float], version: int | str | None
             ) -> TokenCapture:
    if len(logprobs) != len(generation):
        raise UpstreamError("the upstream model server's logprobs do not match its token ids")
    return TokenCapture(list(prompt), list(generation), list(logprobs), version)


def chat_capture(reply: ChatReply, tokenized_prompt: list[int] | None) -> TokenCapture | None:
    """The token ids and logprobs of a chat reply (sources 1-3 above); None when only the prompt ids
    are missing (source 3 without ``tokenized_prompt``: the caller asks ``/tokenize`` and calls again)."""
    choice = reply.choices[0]
    message = choice.message
    if message.prompt_token_ids is not None and message.generation_token_ids is not None:
        return _checked(message.prompt_token_ids, message.generation_token_ids,
                        message.generation_log_probs or [], reply.version)
    entries = choice.logprobs.content if choice.logprobs and choice.logprobs.content is not None else None
    logprobs = [entry.logprob for entry in entries] if entries is not None else []
    logprob_ids = _ids_of_tokens([entry.token for entry in entries]) if entries is not None else None
    prompt = choice.prompt_token_ids if choice.prompt_token_ids is not None else reply.prompt_token_ids
    if (prompt is None) != (choice.token_ids is None):
        missing = "choice token_ids" if choice.token_ids is None else "prompt_token_ids"
        raise UpstreamError(f"the upstream model server returned partial token ids: no {missing}")
    if prompt is not None and choice.token_ids is not None:
        if logprob_ids is not None and logprob_ids != choice.token_ids:
            raise UpstreamError("the upstream model server's token_ids disagree with its logprob tokens")
        return _checked(prompt, choice.token_ids, logprobs, reply.version)
    if logprob_ids is None:
        raise UpstreamError("token ids were asked for, but the upstream model server returned none (it must "
                            "support vLLM's return_token_ids or return_tokens_as_token_ids with logprobs)")
    if tokenized_prompt is None:
        return None
    return _checked(tokenized_prompt, logprob_ids, logprobs, reply.version)


def completion_ids(choice: CompletionChoice) -> tuple[list[int], list[float]]:
    """Generated ids and logprobs of a completion choice (``token_ids`` or ``token_id:<id>`` tokens)."""
    logprobs = choice.logprobs
    if logprobs is None:
        raise UpstreamError("the upstream model server's completion carries no logprobs")
    values = [value for value in logprobs.token_logprobs if value is not None]
    if len(values) != len(logprobs.token_logprobs):
        raise UpstreamError("the upstream model server's completion has a token without a logprob")
    from_tokens = _ids_of_tokens(list(logprobs.tokens)) if logprobs.tokens is not None else None
    ids = choice.token_ids if choice.token_ids is not None else from_tokens
    if ids is None:
        raise UpstreamError("the upstream model server's completion carries no token ids")
    if from_tokens is not None and from_tokens != ids:
        raise UpstreamError("the upstream model server's token_ids disagree with its logprob tokens")
    if len(values) != len(ids):
        raise UpstreamError("the upstream model server's logprobs do not match its token ids")
    return list(ids), values
