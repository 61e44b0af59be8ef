"""The engine interface: what the inference worker's HTTP layer needs from an inference engine.

An engine owns a model and a tokenizer and generates **one token at a time**. The caller consumes an
async iterator of ``TokenStep`` and may stop at any token boundary (closing the iterator cancels the
request at the engine's next step). That is what a generation cut needs: the tokens already taken
are the prefix, and continuing later is just a new ``GenerationRequest`` built by
``GenerationRequest.continuation(prefix_ids)``: prompt + prefix, ``max_tokens`` reduced, same seed.
Engines make that exact by sampling each token as a pure function of (seed, absolute position,
logits) (see ``sampling.py``), so a continued run draws what the uninterrupted run would have drawn.

    Engine (ABC)
    ├── TransformersEngine   transformers_engine.py (CPU, the embedded default)
    └── VllmEngine           vllm_engine.py (GPU)

Pausing: an engine whose ``pausable`` is true stops taking decode steps between
``pause_generation()`` and ``resume_generation()`` (vLLM's ``mode="keep"``: requests stay admitted,
frozen at a token boundary, and go on after the resume; new ones wait). A checkpoint of a CPU mesh
uses it so that the commits do not share the cores with generation (``generation_hold``).

This module imports neither torch nor transformers: ``app.py`` imports it while configs load.
"""

from __future__ import annotations

import abc
import asyncio
import uuid
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, Literal, Protocol

__all__ = [
    "ChatTemplateRequest",
    "Engine",
    "EngineTokenizer",
    "FinishReason",
    "GenerationRequest",
    "TokenStep",
]

FinishReason = Literal["stop", "length"]


class EngineTokenizer(Protocol):
    """The tokenizer view the HTTP layer uses (ids are ints in ``[0, vocab_size)``)."""

    @property
    def eos_token_id(self) -> int | None: ...

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` adds the tokenizer's own (e.g. a BOS)."""
        ...

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str: ...

    def token_text(self, token_id: int) -> str:
        """The text of one token as shown in logprobs (special tokens included)."""
        ...

    def render_chat(self, messages: list[dict[str, Any]], request: ChatTemplateRequest) -> str:
        """The prompt text of chat ``messages`` through the model's chat template.

        Raises ``InvalidRequest`` when the model has no chat template or the template refuses them.
        """
        ...


@dataclass(frozen=True)
class ChatTemplateRequest:
    """How a chat is rendered (vLLM's fields): tools, generation prompt, template keyword arguments."""

    tools: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    template_kwargs: dict[str, Any] = field(default_factory=dict)


def _new_request_id() -> str:
    return f"gen-{uuid.uuid4().hex}"


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """One generation: prompt ids plus sampling settings (``temperature`` 0 means greedy).

    ``stop_token_ids`` end the generation like EOS does (EOS ends it unless ``ignore_eos``); the
    stop token itself is yielded, with its logprob. Stop *strings* are the caller's business.
    """

    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    seed: int
    temperature: float = 1.0
    top_p: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    request_id: str = field(default_factory=_new_request_id)

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError("prompt_token_ids must not be empty")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not (0.0 < self.top_p <= 1.0) or self.temperature < 0.0:
            raise ValueError(f"bad sampling settings: temperature={self.temperature}, top_p={self.top_p}")

    def continuation(self, prefix_ids: Sequence[int]) -> GenerationRequest:
        """The request that continues this one after ``prefix_ids`` were generated.

        Same seed and settings; prompt + prefix; ``max_tokens`` reduced by the prefix length.
        Sampling positions are absolute, so the continuation samples exactly where this one would.
        """
        if len(prefix_ids) >= self.max_tokens:
            raise ValueError(
                f"a prefix of {len(prefix_ids)} tokens leaves nothing of max_tokens={self.max_tokens}"
            )
        return replace(
            self,
            prompt_token_ids=(*self.prompt_token_ids, *prefix_ids),
            max_tokens=self.max_tokens - len(prefix_ids),
            request_id=_new_request_id(),
        )

    def stop_set(self, eos_token_id: int | None) -> frozenset[int]:
        """Every token id that ends this generation."""
        stops = set(self.stop_token_ids)
        if eos_token_id is not None and not self.ignore_eos:
            stops.add(eos_token_id)
        return frozenset(stops)


@dataclass(frozen=True, slots=True)
class TokenStep:
    """One generated token; ``finish_reason`` is set on the last one of the generation.

    ``"stop"``: the token is EOS or one of ``stop_token_ids``; ``"length"``: ``max_tokens`` reached.
    """

    token_id: int
    logprob: float
    finish_reason: FinishReason | None = None


class Engine(abc.ABC):
    """An inference engine behind the worker's ``/v1/completions``.

    Lifecycle: build (engine-specific loader), ``await start()``, ``generate(...)`` any number of
    times concurrently, ``await aclose()``. ``generate`` returns an async iterator; consume it inside
    ``contextlib.aclosing`` so that stopping early cancels the request at once.
    """

    #: Whether ``pause_generation`` stops this engine's steps (it awaits ``_unpaused`` before each).
    pausable: ClassVar[bool] = False

    def __init__(self, *, policy_version: int = 0) -> None:
        self._policy_version = 0
        self.policy_version = policy_version
        self._running = asyncio.Event()
        self._running.set()

    @property
    @abc.abstractmethod
    def tokenizer(self) -> EngineTokenizer: ...

    @property
    @abc.abstractmethod
    def context_length(self) -> int:
        """The most tokens (prompt + generated) one sequence may hold."""

    @property
    def policy_version(self) -> int:
        """The version of the weights being served (set by whoever updates them)."""
        return self._policy_version

    @policy_version.setter
    def policy_version(self, value: int) -> None:
        if value < 0:
            raise ValueError(f"policy_version must be >= 0, got {value}")
        self._policy_version = value

    @property
    def failure(self) -> str | None:
        """Why the engine can serve no more requests (its scheduler died), or None while it can.

        An engine with a failure refuses every new request with 503 and the worker's ``/health``
        answers 503 naming it: only a restart of the worker brings it back."""
        return None

    @property
    def paused(self) -> bool:
        return not self._running.is_set()

    def pause_generation(self) -> None:
        """Take no more steps until ``resume_generation`` (requests stay admitted, frozen)."""
        if not self.pausable:
            raise TypeError(f"{type(self).__name__} does not pause")
        self._running.clear()

    def resume_generation(self) -> None:
        """Go on stepping every request ``pause_generation`` froze (a no-op when not paused)."""
        self._running.set()

    async def _unpaused(self) -> None:
        """Return at once unless paused; then when resumed."""
        if not self._running.is_set():
            await self._running.wait()

    async def start(self) -> None:  # noqa: B027 - optional hook
        """Start background work (a scheduler); called once before the first ``generate``."""

    async def aclose(self) -> None:  # noqa: B027 - optional hook
        """Stop background work and free the model."""

    @abc.abstractmethod
    def generate(self, request: GenerationRequest) -> AsyncGenerator[TokenStep, None]:
        """Tokens of ``request``, one at a time; the last carries a ``finish_reason``."""
