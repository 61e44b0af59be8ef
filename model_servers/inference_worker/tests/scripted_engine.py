"""A scripted engine behind the real ``Engine`` interface, for unit tests of the HTTP layer.

It "generates" a fixed script of token ids (repeated as needed), obeys ``max_tokens``, EOS and
``stop_token_ids`` like a real engine, records what it admitted, and can hold each token behind a
gate so that a test decides when the next one comes.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Sequence

from model_servers.inference_worker.engine import Engine, GenerationRequest, TokenStep
from nemo_gym_ckpt.errors import Unavailable

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

    def encode(self, text: str) -> list[int]:
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
    ) -> None:
        super().__init__()
        self._tokenizer = CharTokenizer()
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
    def tokenizer(self) -> CharTokenizer:
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
        stops = request.stop_set(EOS)
        finished = False
        try:
            for index in range(request.max_tokens):
                if self.gate is not None:
                    await self.gate.acquire()
                await asyncio.sleep(self.pace_s)
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
