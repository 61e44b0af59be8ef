"""Generation on our inference worker: token ids in, token ids and logprobs out.

The prompt is rendered with the model's chat template and sent to the worker's
``/v1/completions`` as token ids (reusing the exact ids of earlier turns, see ``token_splice``: those
the caller sent back, or after a restore those the ledger restored from the token sidecar).
The worker answers the generated ids (the eos token included) and their logprobs; this server
decodes them itself, keeping special tokens, because the tool-call tags are added tokens that a
text reply could drop or alter. Content ends at the eos text or a stop string. A stream's text is
decoded as its ids come (``text_cut.ContentStreamer``), a few ids per token, not all of them again
at every chunk.

A call that comes without a seed but with a ``seed_scope`` (a rollout-scoped call while
checkpointing is on) is sent with ``ids.call_seed(rollout id, prompt digest)``, so the same call
made again by the rollout's next attempt samples the same tokens.

A worker that holds all the completions it may (``max_waiting_requests``) refuses the call up
front (429 ``capacity_exceeded``: nothing of it exists there); the very same request is sent again
after the reply's ``Retry-After``, as the collector sends a refused ``/run`` again, until the call's
deadline (``request_timeout_s``, one for all the tries) leaves no room for another wait
(``resend.admitted``): a call of a rollout that has started is not failed for want of the
worker's capacity, only for want of time.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ValidationError

from model_servers.policy_model.chat_format import ChatFormat, load_chat_format
from model_servers.policy_model.generation import (
    TOKEN_FIELDS,
    ChatCall,
    ChatResult,
    StreamEvent,
    StreamStarted,
    TextDelta,
    TokenCapture,
    ToolCall,
)
from model_servers.policy_model.ids import call_seed, digest_of, object_id, sha256_of
from model_servers.policy_model.resend import admitted
from model_servers.policy_model.sse_reader import read_sse_json
from model_servers.policy_model.text_cut import ContentStreamer, cut_at_markers
from model_servers.policy_model.token_splice import known_prefix, prompt_ids
from model_servers.policy_model.tool_calls import TOOL_CALL_OPEN, ParsedTurn, parse_turn
from nemo_gym_ckpt.client import MeshClient, decode_json
from nemo_gym_ckpt.errors import InternalError, InvalidRequest, UpstreamError

__all__ = ["WorkerBackend"]

logger = logging.getLogger(__name__)

_WORKER = "the inference worker"


class _WorkerLogprobs(BaseModel):
    token_logprobs: list[float]


class _WorkerChoice(BaseModel):
    token_ids: list[int] = []
    prompt_token_ids: list[int] | None = None
    logprobs: _WorkerLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None


class _WorkerReply(BaseModel):
    choices: list[_WorkerChoice]
    policy_version: int | str | None = None


def _choice_of(data: Any, what: str) -> tuple[_WorkerChoice, int | str | None]:
    """The one choice of a worker reply or stream chunk, checked; ``what`` names it in errors."""
    try:
        reply = _WorkerReply.model_validate(data)
    except ValidationError as error:
        detail = f"the inference worker answered an unusable {what}: {error.errors()[0]}"
        raise UpstreamError(detail) from None
    if len(reply.choices) != 1:
        raise UpstreamError(f"the inference worker answered a {what} with {len(reply.choices)} choices, "
                            "expected 1")
    choice = reply.choices[0]
    logprobs = choice.logprobs.token_logprobs if choice.logprobs else []
    if len(logprobs) != len(choice.token_ids):
        raise UpstreamError(f"the inference worker's logprobs do not match its token ids in a {what}")
    return choice, reply.policy_version


class _Generated:
    """Token ids and logprobs gathered from a worker stream."""

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.finish_reason: Literal["stop", "length"] | None = None
        self.policy_version: int | str | None = None

    def add(self, choice: _WorkerChoice, policy_version: int | str | None, prompt: list[int]) -> None:
        if choice.prompt_token_ids is not None and choice.prompt_token_ids != prompt:
            raise UpstreamError("the inference worker answered for a prompt other than the one sent")
        self.ids.extend(choice.token_ids)
        self.logprobs.extend(choice.logprobs.token_logprobs if choice.logprobs else [])
        self.finish_reason = choice.finish_reason or self.finish_reason
        self.policy_version = policy_version if policy_version is not None else self.policy_version


class WorkerBackend:
    """A ``Backend`` that renders chats itself and generates on an inference worker."""

    def __init__(
        self, *, client: MeshClient, url: str, tokenizer_dir: Path | str, model_name: str, timeout_s: float,
        context_length: int | None = None,
    ) -> None:
        self._client = client
        self._url = url.rstrip("/") + "/v1/completions"
        self._tokenizer_dir = tokenizer_dir
        self._model_name = model_name
        self._timeout_s = timeout_s
        self._context_length = context_length
        self._format: ChatFormat | None = None

    @property
    def model_name(self) -> str:
        return self._model_name

    @property
    def format(self) -> ChatFormat:
        if self._format is None:
            raise InternalError("the policy model's tokenizer is not loaded (lifespan not run)")
        return self._format

    async def start(self) -> None:
        self._format = await asyncio.to_thread(load_chat_format, self._tokenizer_dir)

    # ---- prompt ----------------------------------------------------------------------------------

    def _prompt(self, call: ChatCall) -> list[int]:
        text = self.format.render([_template_message(m) for m in call.messages], call.tools)
        prompt = prompt_ids(self.format, text, known_prefix(call.messages), call.ledger_prefixes)
        logger.debug("prompt of %d ids (%d reused from an earlier turn, from the %s)", len(prompt.ids),
                     prompt.reused, prompt.source)
        return prompt.ids

    def _max_tokens(self, call: ChatCall, prompt: list[int]) -> int:
        context = self._context_length or self.format.context_length
        if context is None:
            return call.sampling.max_tokens
        room = context - len(prompt)
        if room <= 0:
            raise InvalidRequest(f"the prompt ({len(prompt)} tokens) fills the model's context of {context} "
                                 "tokens")
        return min(call.sampling.max_tokens, room)

    def _body(self, call: ChatCall, prompt: list[int], prompt_digest: str, *, stream: bool) -> dict[str, Any]:
        sampling = call.sampling
        return {
            "prompt": prompt,
            "max_tokens": self._max_tokens(call, prompt),
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "seed": _seed(call, prompt_digest),
            "stop": list(sampling.stop) or None,
            "logprobs": 1,
            "return_token_ids": True,
            "skip_special_tokens": False,
            "stream": stream,
            **_cut_fields(call),
        }

    # ---- result ----------------------------------------------------------------------------------

    def _markers(self, call: ChatCall) -> list[str]:
        return [self.format.eos_text, *call.sampling.stop]

    def _result(
        self, call: ChatCall, prompt: list[int], prompt_digest: str, generated: _Generated
    ) -> ChatResult:
        if generated.finish_reason is None:
            raise UpstreamError("the inference worker ended a generation without a finish_reason")
        text = cut_at_markers(self.format.decode(generated.ids), self._markers(call))
        turn = parse_turn(text) if call.parse_tool_calls else ParsedTurn(text, [])
        digest = digest_of(prompt, generated.ids)
        calls = [
            ToolCall(object_id("call_", digest, i), parsed.name, parsed.arguments)
            for i, parsed in enumerate(turn.calls)
        ]
        finish = "tool_calls" if calls and generated.finish_reason == "stop" else generated.finish_reason
        capture = None
        if call.want_tokens:
            capture = TokenCapture(list(prompt), generated.ids, generated.logprobs, generated.policy_version)
        return ChatResult(
            turn.content, calls, finish, len(prompt), len(generated.ids), digest, capture,
            prompt_digest=prompt_digest, output_digest=sha256_of(generated.ids),
            policy_version=generated.policy_version,
        )

    # ---- calls -----------------------------------------------------------------------------------

    async def complete(self, call: ChatCall) -> ChatResult:
        prompt = self._prompt(call)
        prompt_digest = sha256_of(prompt)
        body = self._body(call, prompt, prompt_digest, stream=False)
        deadline = asyncio.get_running_loop().time() + self._timeout_s
        response = await admitted(
            lambda left_s: self._client.request("POST", self._url, json=body, timeout_s=left_s), deadline, _WORKER)
        choice, policy_version = _choice_of(decode_json(response), "completion")
        generated = _Generated()
        generated.add(choice, policy_version, prompt)
        return self._result(call, prompt, prompt_digest, generated)

    async def stream(self, call: ChatCall) -> AsyncGenerator[StreamEvent, None]:
        prompt = self._prompt(call)
        prompt_digest = sha256_of(prompt)
        deadline = asyncio.get_running_loop().time() + self._timeout_s
        body = self._body(call, prompt, prompt_digest, stream=True)
        async with contextlib.AsyncExitStack() as stack:
            response = await admitted(lambda left_s: stack.enter_async_context(
                self._client.stream("POST", self._url, json=body, timeout_s=left_s)), deadline, _WORKER)
            yield StreamStarted(digest_of(prompt))
            markers = self._markers(call) + ([TOOL_CALL_OPEN] if call.parse_tool_calls else [])
            streamer = ContentStreamer(self.format, markers)
            generated = _Generated()
            async for event in read_sse_json(response, deadline):
                choice, policy_version = _choice_of(event, "stream chunk")
                generated.add(choice, policy_version, prompt)
                delta = streamer.add(choice.token_ids)
                if delta:
                    yield TextDelta(delta)
        result = self._result(call, prompt, prompt_digest, generated)
        rest = streamer.finish(result.content)
        if rest:
            yield TextDelta(rest)
        yield result


def _seed(call: ChatCall, prompt_digest: str) -> int | None:
    """The request's seed; without one, a rollout-scoped call's seed derived from its prompt."""
    if call.sampling.seed is not None or call.seed_scope is None:
        return call.sampling.seed
    return call_seed(call.seed_scope, prompt_digest)


def _cut_fields(call: ChatCall) -> dict[str, Any]:
    """The call's generation-cut fields for the worker (none unless cuts are on)."""
    fields: dict[str, Any] = {}
    if call.model_call is not None:
        fields["model_call"] = call.model_call.to_json()
    if call.continuation is not None:
        fields["continuation"] = call.continuation.to_json()
    return fields


def _template_message(message: dict[str, Any]) -> dict[str, Any]:
    """A message as the chat template sees it: no token fields; ``developer`` spoken as ``system``."""
    rendered = {key: value for key, value in message.items() if key not in TOKEN_FIELDS}
    if rendered["role"] == "developer":
        rendered["role"] = "system"
    return rendered
