"""OpenAI ``/v1/completions`` with vLLM-style extensions: request checks, text assembly, bodies.

``CompletionRequest`` is the wire body; ``plan_completion`` checks it against the engine (model name,
unsupported fields, vocabulary, context length) and turns it into a ``GenerationRequest`` plus output
options; ``CompletionBuilder`` consumes the engine's ``TokenStep``s and keeps the text, token ids,
logprobs, stop handling and streaming deltas.

Stop rules: a stop token (EOS or one of ``stop_token_ids``) is kept in ``token_ids`` and logprobs
but not in ``text``; a stop string ends generation and is cut from ``text``, while ``token_ids``
run up to and including the token that completed it.

Cost per token: the text is decoded incrementally (``detokenizer``) and stop strings are searched
only where a new match can be: the characters a token changed, and the ``len(longest stop) - 1``
before them (an earlier match would have ended the generation already). A reply of ``n`` tokens is
built in time linear in ``n``; the text is exactly what decoding all the ids and searching all the
text at every token gives.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr

from model_servers.inference_worker.cut_models import ContinuationRef, ModelCall
from model_servers.inference_worker.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer
from model_servers.inference_worker.engine import Engine, EngineTokenizer, GenerationRequest, TokenStep
from nemo_gym_ckpt.bounds import MAX_TEXT, MAX_TOKEN_ID, MAX_TOKENS, Name, Seed
from nemo_gym_ckpt.errors import InternalError, InvalidRequest, NotFound

__all__ = [
    "CompletionBuilder",
    "CompletionPlan",
    "CompletionRequest",
    "StreamOptions",
    "check_prompt_fits",
    "check_token_ids",
    "plan_completion",
]

#: Accepted with any value and ignored (no effect on what is generated).
IGNORED_FIELDS = frozenset({"user", "metadata", "store", "service_tier", "request_id", "priority",
                            "spaces_between_special_tokens"})
#: Accepted only at their no-op values: anything else would change semantics we do not implement.
NEUTRAL_VALUES: dict[str, tuple[Any, ...]] = {
    "echo": (False, None),
    "best_of": (1, None),
    "suffix": (None, ""),
    "logit_bias": (None, {}),
    "presence_penalty": (0, None),
    "frequency_penalty": (0, None),
    "repetition_penalty": (1, None),
    "top_k": (-1, 0, None),
    "min_p": (0, None),
    "min_tokens": (0, None),
    "include_stop_str_in_output": (False, None),
    "prompt_logprobs": (None,),
    "truncate_prompt_tokens": (None,),
    "allowed_token_ids": (None,),
    "bad_words": (None, []),
    "response_format": (None,),
    "structured_outputs": (None,),
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None,),
    "guided_grammar": (None,),
    "logits_processors": (None,),
}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


StopTexts = Annotated[StrictStr, Field(max_length=256)] | Annotated[
    list[Annotated[StrictStr, Field(max_length=256)]], Field(max_length=16)]
"""``stop``: one text or up to 16, each at most 256 characters."""
StopTokenIds = Annotated[list[Annotated[StrictInt, Field(ge=0, le=MAX_TOKEN_ID)]], Field(max_length=1024)]
"""``stop_token_ids``: up to 1,024 token ids."""


class CompletionRequest(BaseModel):
    """The body of ``POST /v1/completions`` (one prompt: text or token ids)."""

    model_config = ConfigDict(extra="allow")

    model: Name | None = None
    prompt: Annotated[StrictStr, Field(max_length=MAX_TEXT)] | Annotated[  # the vocabulary is checked later
        list[Annotated[StrictInt, Field(ge=-MAX_TOKEN_ID, le=MAX_TOKEN_ID)]], Field(max_length=MAX_TOKENS)]
    max_tokens: int | None = Field(16, ge=1, le=MAX_TOKENS)
    temperature: float | None = Field(None, ge=0, le=1e6, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0, le=1, allow_inf_nan=False)
    seed: Seed | None = None
    stop: StopTexts | None = None
    stop_token_ids: StopTokenIds | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: int | None = Field(None, ge=0, le=1024)
    return_token_ids: bool = False
    #: vLLM: logprob tokens written as ``token_id:<id>`` instead of their text.
    return_tokens_as_token_ids: bool | None = None
    #: vLLM: a text prompt is tokenized with the tokenizer's special tokens (e.g. a BOS) unless false.
    add_special_tokens: bool = True
    skip_special_tokens: bool = True
    n: int | None = Field(1, ge=1, le=128)
    #: Generation cuts (checkpointing on only, see ``cut_models``): the policy model's call, and a
    #: staged prefix to continue.
    model_call: ModelCall | None = None
    continuation: ContinuationRef | None = None


@dataclass(frozen=True)
class CompletionPlan:
    """A checked request: what to generate and how to shape the reply."""

    generation: GenerationRequest
    stop_strings: tuple[str, ...]
    logprobs: bool
    return_token_ids: bool
    skip_special_tokens: bool
    tokens_as_ids: bool
    stream: bool
    seed_was_given: bool


def _check_fields(body: CompletionRequest) -> None:
    for name, value in (body.model_extra or {}).items():
        if name in IGNORED_FIELDS:
            continue
        if name not in NEUTRAL_VALUES:
            raise InvalidRequest(f"unknown field {name!r}")
        if value not in NEUTRAL_VALUES[name]:
            raise InvalidRequest(f"field {name!r}={value!r} is not supported by this worker")
    if body.n not in (1, None):
        raise InvalidRequest(f"n={body.n} is not supported: one choice per request")
    if body.logprobs is not None and body.logprobs > 1:
        raise InvalidRequest(f"logprobs={body.logprobs} is not supported: top-k logprobs are not "
                             "implemented; use 0 or 1 for the sampled token's logprob")


def check_token_ids(ids: list[int], vocab_size: int, what: str) -> None:
    """400 naming ``what`` when an id lies outside ``[0, vocab_size)``."""
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise InvalidRequest(f"{what} holds token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")


def _prompt_ids(body: CompletionRequest, tokenizer: EngineTokenizer) -> list[int]:
    if isinstance(body.prompt, str):
        if not body.prompt:
            raise InvalidRequest("prompt must not be empty")
        ids = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    else:
        ids = body.prompt
        check_token_ids(ids, tokenizer.vocab_size, "prompt")
    if not ids:
        raise InvalidRequest("prompt must hold at least one token")
    return ids


def check_prompt_fits(prompt_len: int, context: int) -> None:
    """400 when a prompt of ``prompt_len`` tokens leaves no room for a token in ``context`` (or holds
    more than a request's ``MAX_TOKENS``)."""
    if prompt_len >= context:
        raise InvalidRequest(f"the prompt ({prompt_len} tokens) leaves no room in the model's context length "
                             f"of {context} tokens")
    if prompt_len > MAX_TOKENS:
        raise InvalidRequest(f"the prompt ({prompt_len} tokens) holds more than the {MAX_TOKENS} tokens a "
                             "request may hold")


def _max_tokens(body: CompletionRequest, prompt_len: int, context: int) -> int:
    check_prompt_fits(prompt_len, context)
    room = context - prompt_len
    if body.max_tokens is None:
        return room
    if body.max_tokens > room:
        raise InvalidRequest(f"prompt ({prompt_len} tokens) + max_tokens ({body.max_tokens}) exceeds the "
                             f"model's context length of {context} tokens")
    return body.max_tokens


def _stop_strings(stop: str | list[str] | None) -> tuple[str, ...]:
    strings = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if any(not s for s in strings):
        raise InvalidRequest("stop strings must not be empty")
    return strings


def plan_completion(
    body: CompletionRequest, engine: Engine, *, served_model: str, next_seed: Callable[[], int]
) -> CompletionPlan:
    """Check ``body`` against the engine; ``next_seed`` gives a seed to a request without one."""
    if body.model is not None and body.model != served_model:
        raise NotFound(f"model {body.model!r} is not served here; this worker serves {served_model!r}")
    _check_fields(body)
    tokenizer = engine.tokenizer
    prompt = _prompt_ids(body, tokenizer)
    stop_ids = body.stop_token_ids or []
    check_token_ids(stop_ids, tokenizer.vocab_size, "stop_token_ids")
    generation = GenerationRequest(
        prompt_token_ids=tuple(prompt),
        max_tokens=_max_tokens(body, len(prompt), engine.context_length),
        seed=body.seed if body.seed is not None else next_seed(),
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        stop_token_ids=tuple(stop_ids),
        ignore_eos=body.ignore_eos,
    )
    return CompletionPlan(
        generation=generation,
        stop_strings=_stop_strings(body.stop),
        logprobs=body.logprobs is not None,
        return_token_ids=body.return_token_ids,
        skip_special_tokens=body.skip_special_tokens,
        tokens_as_ids=bool(body.return_tokens_as_token_ids),
        stream=body.stream,
        seed_was_given=body.seed is not None,
    )


@dataclass
class _Cursor:
    """How much of the text and of the token lists a stream has already sent."""

    text: int = 0
    tokens: int = 0


@dataclass
class CompletionBuilder:
    """Accumulates one choice from ``TokenStep``s and renders bodies and stream chunks."""

    plan: CompletionPlan
    tokenizer: EngineTokenizer
    served_model: str
    policy_version: int
    id: str = field(default_factory=lambda: f"cmpl-{uuid.uuid4().hex}")
    created: int = field(default_factory=lambda: int(time.time()))
    token_ids: list[int] = field(default_factory=list)
    token_logprobs: list[float] = field(default_factory=list)
    text_offsets: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    last_step_finish: str | None = None  # the engine's finish reason of the last token taken
    _detokenizer: IncrementalDetokenizer = field(init=False, repr=False)
    _stop_at: int | None = None  # a stop string began here: the text ends before it
    _sent: _Cursor = field(default_factory=_Cursor)

    def __post_init__(self) -> None:
        self._detokenizer = IncrementalDetokenizer(self.tokenizer,
                                                   skip_special_tokens=self.plan.skip_special_tokens)

    @property
    def text(self) -> str:
        """The choice's text (read whole, it is joined: once, for the reply)."""
        text = self._detokenizer.text
        return text if self._stop_at is None else text[: self._stop_at]

    def _text_length(self) -> int:
        return len(self._detokenizer) if self._stop_at is None else self._stop_at

    def _text_from(self, start: int) -> str:
        """``text[start:]``, in time proportional to its length."""
        return self._detokenizer.text_from(start)[: max(0, self._text_length() - start)]

    # ---- accumulation ----------------------------------------------------------------------------

    def add(self, step: TokenStep) -> bool:
        """Take one token; True once the choice is finished (stop the engine then)."""
        if self.finish_reason is not None:
            raise InternalError("a token arrived after the choice finished")
        self.token_ids.append(step.token_id)
        self.token_logprobs.append(step.logprob)
        self.last_step_finish = step.finish_reason
        self.text_offsets.append(self._text_length())
        if step.finish_reason == "stop":
            eos = self.tokenizer.eos_token_id
            user_stop = step.token_id in self.plan.generation.stop_token_ids
            return self._finish("stop", step.token_id if user_stop or step.token_id != eos else None)
        if self._cut_stop_string(self._detokenizer.add(step.token_id)):
            return True
        if step.finish_reason == "length":
            return self._finish("length", None)
        return False

    def close(self) -> None:
        """The engine's iterator ended: it must have finished the choice."""
        if self.finish_reason is None:
            raise InternalError("the engine ended a generation without a finish reason")

    def _cut_stop_string(self, unchanged: int) -> bool:
        """End at the earliest stop string (the least string among those at the same index); only a
        match that reaches past the first ``unchanged`` characters can be new."""
        stops = self.plan.stop_strings
        if not stops:
            return False
        start = max(0, unchanged - max(len(s) for s in stops) + 1)
        tail = self._detokenizer.text_from(start)
        found = [(index, s) for index, s in ((tail.find(s), s) for s in stops) if index >= 0]
        if not found:
            return False
        index, stop = min(found)
        self._stop_at = start + index
        return self._finish("stop", stop)

    def _finish(self, reason: str, stop_reason: int | str | None) -> bool:
        self.finish_reason = reason
        self.stop_reason = stop_reason
        length = self._text_length()
        self.text_offsets = [min(offset, length) for offset in self.text_offsets]
        return True

    # ---- rendering -------------------------------------------------------------------------------

    def _logprobs(self, start: int) -> dict[str, Any] | None:
        if not self.plan.logprobs:
            return None
        return {
            "tokens": self.token_strings(start),
            "token_logprobs": self.token_logprobs[start:],
            "top_logprobs": None,
            "text_offset": self.text_offsets[start:],
        }

    def token_strings(self, start: int = 0) -> list[str]:
        """The tokens from ``start`` as logprobs show them: their text, or ``token_id:<id>`` (vLLM's
        ``return_tokens_as_token_ids``)."""
        ids = self.token_ids[start:]
        if self.plan.tokens_as_ids:
            return [f"token_id:{i}" for i in ids]
        return [self.tokenizer.token_text(i) for i in ids]

    def usage(self) -> dict[str, int]:
        prompt = len(self.plan.generation.prompt_token_ids)
        return {"prompt_tokens": prompt, "completion_tokens": len(self.token_ids),
                "total_tokens": prompt + len(self.token_ids)}

    def _envelope(self, choice: dict[str, Any], usage: dict[str, int] | None) -> dict[str, Any]:
        return {"id": self.id, "object": "text_completion", "created": self.created,
                "model": self.served_model, "choices": [choice], "usage": usage,
                "policy_version": self.policy_version}

    def response(self) -> dict[str, Any]:
        """The whole (non-streaming) reply."""
        choice: dict[str, Any] = {
            "index": 0, "text": self.text, "finish_reason": self.finish_reason,
            "stop_reason": self.stop_reason, "logprobs": self._logprobs(0),
            "seed": self.plan.generation.seed,
        }
        if self.plan.return_token_ids:
            choice["token_ids"] = list(self.token_ids)
            choice["prompt_token_ids"] = list(self.plan.generation.prompt_token_ids)
        return self._envelope(choice, self.usage())

    def chunk(self) -> dict[str, Any] | None:
        """The next stream chunk (what is new since the last one), or None if nothing is new.

        Text that could still turn out to be the start of a stop string (or an incomplete UTF-8
        character) is held back until it cannot; the finishing chunk carries the rest and usage.
        """
        finished = self.finish_reason is not None
        unsent = self._text_from(self._sent.text)
        sendable = len(unsent) if finished else self._safe_length(unsent)
        safe = self._sent.text + sendable
        start = self._sent.tokens
        if not finished and start == len(self.token_ids) and not sendable:
            return None
        choice: dict[str, Any] = {
            "index": 0, "text": unsent[:sendable],
            "finish_reason": self.finish_reason, "stop_reason": self.stop_reason,
            "logprobs": self._logprobs(start),
        }
        if self.plan.return_token_ids:
            choice["token_ids"] = self.token_ids[start:]
            if start == 0:
                choice["prompt_token_ids"] = list(self.plan.generation.prompt_token_ids)
        if start == 0 or finished:
            choice["seed"] = self.plan.generation.seed
        self._sent = _Cursor(safe, len(self.token_ids))
        return self._envelope(choice, self.usage() if finished else None)

    def _safe_length(self, unsent: str) -> int:
        """How much of ``unsent`` (the text after what was sent) cannot become part of a stop string
        or of a character still incomplete."""
        hold = max((len(s) for s in self.plan.stop_strings), default=1) - 1
        safe = len(unsent) - hold
        while safe > 0 and unsent[safe - 1] == REPLACEMENT_CHAR:
            safe -= 1
        return max(safe, 0)
