"""Generation on an external OpenAI-compatible server (``upstream`` mode; no generation cuts).

The call is forwarded to ``<base_url>/chat/completions`` through the mesh client (outside the
rollout prefix: the external server knows nothing of it), with the token fields stripped from the
messages. With token capture asked, the request also asks for vLLM's ``logprobs`` and
``return_token_ids`` and the reply must carry token ids, either NeMo RL style on the message or
vLLM style (``prompt_token_ids`` plus the choice's ``token_ids`` and ``logprobs.content``).
Streaming is served by replaying the finished reply. Without token ids, the ledger digests are
those of the messages sent and of the reply, and a derived seed (``ChatCall.seed_scope``) comes
from the messages' digest.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any

import httpx
from pydantic import BaseModel, SecretStr, ValidationError

from model_servers.policy_model.generation import (
    TOKEN_FIELDS,
    ChatCall,
    ChatResult,
    FinishReason,
    StreamEvent,
    StreamStarted,
    TextDelta,
    TokenCapture,
    ToolCall,
)
from model_servers.policy_model.ids import call_seed, digest_of, object_id, sha256_of
from nemo_gym_ckpt.client import MeshClient, decode_json
from nemo_gym_ckpt.errors import GymError, InvalidRequest, Unavailable, UpstreamError, UpstreamTimeout

__all__ = ["UpstreamBackend"]

_CLIENT_FAULT = frozenset({400, 413, 422})


class _Function(BaseModel):
    name: str
    arguments: str


class _UpToolCall(BaseModel):
    id: str | None = None
    function: _Function


class _UpMessage(BaseModel):
    content: str | None = None
    tool_calls: list[_UpToolCall] | None = None
    prompt_token_ids: list[int] | None = None
    generation_token_ids: list[int] | None = None
    generation_log_probs: list[float] | None = None
    policy_version: int | str | None = None


class _UpLogprob(BaseModel):
    logprob: float


class _UpLogprobs(BaseModel):
    content: list[_UpLogprob] | None = None


class _UpChoice(BaseModel):
    message: _UpMessage
    finish_reason: str | None = None
    logprobs: _UpLogprobs | None = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None


class _UpUsage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0


class _UpReply(BaseModel):
    choices: list[_UpChoice]
    usage: _UpUsage | None = None
    prompt_token_ids: list[int] | None = None
    policy_version: int | str | None = None


class UpstreamBackend:
    """A ``Backend`` that forwards chats to an external OpenAI-compatible server."""

    def __init__(
        self, *, client: MeshClient, base_url: str, api_key: SecretStr | None, model: str, model_name: str,
        timeout_s: float,
    ) -> None:
        self._client = client
        self._url = base_url.rstrip("/") + "/chat/completions"
        self._headers = {"authorization": f"Bearer {api_key.get_secret_value()}"} if api_key else {}
        self._model = model
        self._model_name = model_name
        self._timeout_s = timeout_s

    @property
    def model_name(self) -> str:
        return self._model_name

    async def start(self) -> None:
        """Nothing to load: the external server renders and tokenizes."""

    def _body(self, call: ChatCall) -> dict[str, Any]:
        sampling = call.sampling
        body: dict[str, Any] = {
            "model": self._model,
            "messages": [{k: v for k, v in m.items() if k not in TOKEN_FIELDS} for m in call.messages],
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "max_tokens": sampling.max_tokens,
        }
        if call.tools:
            body.update(tools=call.tools, tool_choice=call.tool_choice)
        if sampling.seed is not None:
            body["seed"] = sampling.seed
        elif call.seed_scope is not None:
            body["seed"] = call_seed(call.seed_scope, sha256_of(body["messages"]))
        if sampling.stop:
            body["stop"] = list(sampling.stop)
        if call.want_tokens:
            body.update(logprobs=True, return_token_ids=True)
        return body

    async def complete(self, call: ChatCall) -> ChatResult:
        body = self._body(call)
        response = await self._client.request(
            "POST", self._url, json=body, headers=self._headers, rollout_prefix=False, check=False,
            timeout_s=self._timeout_s,
        )
        if response.status_code >= 400:
            raise _upstream_error(response)
        return _result(_parse(decode_json(response)), call, body["messages"])

    async def stream(self, call: ChatCall) -> AsyncGenerator[StreamEvent, None]:
        result = await self.complete(call)
        yield StreamStarted(result.digest)
        if result.content:
            yield TextDelta(result.content)
        yield result


def _upstream_error(response: httpx.Response) -> GymError:
    detail = f"the upstream model server answered {response.status_code}: {_error_message(response)}"
    if response.status_code in _CLIENT_FAULT:
        return InvalidRequest(detail)
    if response.status_code == 503:
        return Unavailable(detail)
    if response.status_code == 504:
        return UpstreamTimeout(detail)
    return UpstreamError(detail)


def _error_message(response: httpx.Response) -> str:
    try:
        error = response.json().get("error")
    except (ValueError, AttributeError):
        return response.text[:200]
    if isinstance(error, dict):
        return str(error.get("message") or error.get("detail") or error)[:500]
    return str(error)[:500]


def _parse(data: Any) -> _UpReply:
    try:
        reply = _UpReply.model_validate(data)
    except ValidationError as error:
        detail = f"the upstream model server answered an unusable reply: {error.errors()[0]}"
        raise UpstreamError(detail) from None
    if len(reply.choices) != 1:
        raise UpstreamError(f"the upstream model server answered {len(reply.choices)} choices, expected 1")
    return reply


def _finish_reason(choice: _UpChoice, has_calls: bool) -> FinishReason:
    if choice.finish_reason == "length":
        return "length"
    return "tool_calls" if has_calls else "stop"


def _result(reply: _UpReply, call: ChatCall, sent_messages: list[dict[str, Any]]) -> ChatResult:
    choice = reply.choices[0]
    message = choice.message
    content = message.content or ""
    digest = digest_of(sent_messages, content, [c.model_dump() for c in message.tool_calls or []])
    calls = [
        ToolCall(c.id or object_id("call_", digest, i), c.function.name, c.function.arguments)
        for i, c in enumerate(message.tool_calls or [])
    ]
    capture = _capture(reply) if call.want_tokens else None
    usage = reply.usage or _UpUsage()
    prompt_tokens = len(capture.prompt_token_ids) if capture else usage.prompt_tokens
    completion_tokens = len(capture.generation_token_ids) if capture else usage.completion_tokens
    prompt_digest, output_digest = _ledger_digests(capture, sent_messages, content, calls)
    version = message.policy_version if message.policy_version is not None else reply.policy_version
    return ChatResult(
        content, calls, _finish_reason(choice, bool(calls)), prompt_tokens, completion_tokens, digest,
        capture, prompt_digest=prompt_digest, output_digest=output_digest, policy_version=version,
    )


def _ledger_digests(
    capture: TokenCapture | None, sent: list[dict[str, Any]], content: str, calls: list[ToolCall]
) -> tuple[str, str]:
    """Token digests when the ids came back; else digests of the messages sent and of the reply."""
    if capture is not None:
        return sha256_of(capture.prompt_token_ids), sha256_of(capture.generation_token_ids)
    return sha256_of(sent), sha256_of([content, [call.to_chat() for call in calls]])


def _capture(reply: _UpReply) -> TokenCapture:
    choice = reply.choices[0]
    message = choice.message
    version = message.policy_version if message.policy_version is not None else reply.policy_version
    if message.prompt_token_ids is not None and message.generation_token_ids is not None:
        logprobs = message.generation_log_probs or []
        return _checked(message.prompt_token_ids, message.generation_token_ids, logprobs, version)
    prompt = choice.prompt_token_ids if choice.prompt_token_ids is not None else reply.prompt_token_ids
    if prompt is None or choice.token_ids is None:
        raise UpstreamError("token ids were asked for, but the upstream model server returned none "
                            "(it must support vLLM's return_token_ids)")
    logprobs = [entry.logprob for entry in (choice.logprobs.content or [])] if choice.logprobs else []
    return _checked(prompt, choice.token_ids, logprobs, version)


def _checked(
    prompt: list[int], generation: list[int], logprobs: list[float], version: int | str | None
) -> TokenCapture:
    if len(logprobs) != len(generation):
        raise UpstreamError("the upstream model server's logprobs do not match its token ids")
    return TokenCapture(prompt, generation, logprobs, version)
