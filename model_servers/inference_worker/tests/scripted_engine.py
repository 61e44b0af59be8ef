"""A scripted engine behind the real ``Engine`` interface, for unit tests of the HTTP layer.

It "generates" a fixed script of token ids (repeated as needed), obeys ``max_tokens``, EOS and
``stop_token_ids`` like a real engine, records what it admitted, and can hold each token behind a
gate so that a test decides when the next one comes. Its tokenizer is ``CharTokenizer`` (one id
per character, a small chat template of its own) unless a real one is given.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, Sequence
from typing import Any

from model_servers.inference_worker.engine import (
    ChatTemplateRequest,
    Engine,
    EngineTokenizer,
    GenerationRequest,
    TokenStep,
)
from nemo_gym_ckpt.errors import InvalidRequest, Unavailable

SPECIALS = ("<pad>", "<bos>", "<|end|>", "<|user|>")
EOS = 2


class CharTokenizer:
    """One id per character (printable ASCII) after four special tokens; EOS is ``<|end|>``."""

    def __init__(self) -> None:
        self.vocab = [*SPECIALS, *(chr(i) for i in range(32, 127))]
        self.ids = {token: index for index, token in enumerate(self.vocab)}

    @property
    def eos_token_id(self) -> int:
        return EOS

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Special tokens are spelled out in the text; none is ever added."""
        ids: list[int] = []
        rest = text
        while rest:
            special = next((s for s in SPECIALS if rest.startswith(s)), None)
            token = special or rest[0]
            ids.append(self.ids.get(token, self.ids["?"]))
            rest = rest[len(token) :]
        return ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return "".join(self.vocab[i] for i in ids if not (skip_special_tokens and i < len(SPECIALS)))

    def token_text(self, token_id: int) -> str:
        return self.vocab[token_id]

    def render_chat(self, messages: list[dict[str, Any]], request: ChatTemplateRequest) -> str:
        """``<bos>``, ``T:name,name<|end|>`` for tools, ``<|user|>text<|end|>`` for a user turn and
        ``A:text<|end|>`` for an assistant turn (tool calls as Hermes blocks), ``r:text<|end|>`` for
        another role starting with ``r``, then ``A:`` as the generation prompt; ``think=1;`` first
        with ``chat_template_kwargs`` ``{"think": true}``; a system message ``refuse`` is refused."""
        if any(m["role"] == "system" and m["content"] == "refuse" for m in messages):
            raise InvalidRequest("the chat template refused these messages: refuse")
        text = "<bos>" + ("think=1;" if request.template_kwargs.get("think") else "")
        if request.tools:
            text += "T:" + ",".join(tool["function"]["name"] for tool in request.tools) + "<|end|>"
        for message in messages:
            head = {"user": "<|user|>", "assistant": "A:"}.get(message["role"], f"{message['role'][0]}:")
            body = message["content"] or ""
            for call in message.get("tool_calls") or []:
                function = call["function"]
                block = {"name": function["name"], "arguments": function["arguments"]}
                body += f"<tool_call>{json.dumps(block, separators=(',', ':'))}</tool_call>"
            closing = "" if request.continue_final_message and message is messages[-1] else "<|end|>"
            text += head + body + closing
        return text + ("A:" if request.add_generation_prompt else "")


class ScriptedEngine(Engine):
    """Yields ``script`` (token ids, cycled) with logprob ``-0.01 * (index + 1)`` per token.

    ``gated``: each token waits for ``release``; ``pace_s``: each token takes that long (a slow
    engine for disconnect tests, whose outcome is then awaited with a deadline); ``fail_after``: raise
    ``Unavailable`` instead of that token.
    """

    def __init__(
        self,
        script: Sequence[int],
        *,
        context_length: int = 64,
        gated: bool = False,
        pace_s: float = 0.0,
        fail_after: int | None = None,
        tokenizer: EngineTokenizer | None = None,
    ) -> None:
        super().__init__()
        self._tokenizer = tokenizer or CharTokenizer()
        self._context_length = context_length
        self.script = list(script)
        self.admitted: list[GenerationRequest] = []
        self.cancelled: list[str] = []
        self.gate: asyncio.Semaphore | None = asyncio.Semaphore(0) if gated else None
        self.pace_s = pace_s
        self.fail_after = fail_after
        self.started = False
        self.closed = False

    @classmethod
    def from_text(cls, text: str, **kwargs: float | bool | None) -> ScriptedEngine:
        return cls(CharTokenizer().encode(text), **kwargs)  # type: ignore[arg-type]

    @property
    def tokenizer(self) -> EngineTokenizer:
        return self._tokenizer

    @property
    def context_length(self) -> int:
        return self._context_length

    async def start(self) -> None:
        self.started = True

    async def aclose(self) -> None:
        self.closed = True

    def release(self, tokens: int) -> None:
        """Let ``tokens`` more tokens through the gate."""
        assert self.gate is not None
        for _ in range(tokens):
            self.gate.release()

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[TokenStep, None]:
        self.admitted.append(request)
        stops = request.stop_set(self._tokenizer.eos_token_id)
        finished = False
        try:
            for index in range(request.max_tokens):
                if self.gate is not None:
                    await self.gate.acquire()
                await asyncio.sleep(self.pace_s)
                await self._unpaused()  # only ever paused in a subclass with ``pausable = True``
                if index == self.fail_after:
                    raise Unavailable("the scripted engine lost its device")
                token = self.script[index % len(self.script)]
                last = index + 1 == request.max_tokens
                finish = "stop" if token in stops else "length" if last else None
                finished = finish is not None
                yield TokenStep(token, -0.01 * (index + 1), finish)
                if finished:
                    return
        finally:
            if not finished:
                self.cancelled.append(request.request_id)
