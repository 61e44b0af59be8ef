"""A scripted engine behind the real ``Engine`` interface: answers chosen by rules, not by a model.

``engine: script`` makes the worker answer from its ``script`` instead of a model: the first rule
whose ``when`` texts all occur in the prompt (decoded with the default model's tokenizer, chat
template included) gives the answer, ``say``, tokenized with the same tokenizer and ended by EOS;
no rule matching gives ``script_default``. Everything around it is the real worker and the real
policy model (chat template, token ids, logprobs, streaming, the capture fields), so a mesh can run
NeMo Gym's judge verifiers (and policies whose right answers are known) offline and reproducibly.
It is what docs/verifiers.md means by "a scripted engine behind the real worker interface".

Each token takes ``delay_s`` of the rule (a slow judge keeps verifications in flight for a test);
a continuation (a prompt that already ends with the start of the answer, after a generation cut)
goes on with the rest. The logprob of every token is 0 (the script is certain). The context length
is the worker's ``max_model_len`` (the policy model reads the same setting; set it: the default
model's tokenizer alone would allow 256 tokens), else 131072.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

from model_servers.inference_worker.engine import Engine, FinishReason, GenerationRequest, TokenStep
from model_servers.inference_worker.hf_tokenizer import HFTokenizer

__all__ = ["SCRIPT_CONTEXT_LENGTH", "ScriptEngine", "ScriptRule"]

SCRIPT_CONTEXT_LENGTH = 1 << 17


class ScriptRule(BaseModel):
    """One answer of the script: ``say`` when every text of ``when`` is in the prompt."""

    model_config = ConfigDict(extra="forbid")

    when: list[str] = Field(min_length=1)
    say: str
    delay_s: float = Field(0.0, ge=0.0, le=10.0)


@dataclass(frozen=True)
class _Answer:
    token_ids: tuple[int, ...]
    delay_s: float


class ScriptEngine(Engine):
    """Answers by ``rules`` (first match), else ``default``; tokens through ``tokenizer``."""

    pausable = True

    def __init__(self, tokenizer: HFTokenizer, rules: Sequence[ScriptRule], default: str, *,
                 context_length: int = SCRIPT_CONTEXT_LENGTH, policy_version: int = 0) -> None:
        super().__init__(policy_version=policy_version)
        self._tokenizer = tokenizer
        self._context_length = context_length
        self.rules = list(rules)
        self.default = default
        self.prompts: list[str] = []
        """Every prompt answered, decoded (the last 256)."""

    @classmethod
    def load(cls, tokenizer_path: str, rules: Sequence[ScriptRule], default: str, *,
             context_length: int = SCRIPT_CONTEXT_LENGTH) -> ScriptEngine:
        """Blocking (the tokenizer loads from disk): call it in a thread from async code."""
        return cls(HFTokenizer.load(tokenizer_path), rules, default, context_length=context_length)

    @property
    def tokenizer(self) -> HFTokenizer:
        return self._tokenizer

    @property
    def context_length(self) -> int:
        return self._context_length

    def answer_for(self, prompt: str) -> tuple[str, float]:
        """The text the script says to ``prompt``, and its delay per token."""
        for rule in self.rules:
            if all(text in prompt for text in rule.when):
                return rule.say, rule.delay_s
        return self.default, 0.0

    def _answer(self, prompt_ids: Sequence[int]) -> tuple[_Answer, int]:
        """The answer's ids and how many of them the prompt already ends with (a continuation)."""
        prompt = self._tokenizer.decode(prompt_ids, skip_special_tokens=False)
        self.prompts = [*self.prompts[-255:], prompt]
        text, delay_s = self.answer_for(prompt)
        ids = [*self._tokenizer.encode(text, add_special_tokens=False)]
        eos = self._tokenizer.eos_token_id
        if eos is not None:
            ids.append(eos)
        done = next((k for k in range(len(ids) - 1, 0, -1) if tuple(prompt_ids[-k:]) == tuple(ids[:k])), 0)
        return _Answer(tuple(ids), delay_s), done

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[TokenStep, None]:
        answer, done = self._answer(request.prompt_token_ids)
        stops = request.stop_set(self._tokenizer.eos_token_id)
        rest = answer.token_ids[done:]
        for index, token in enumerate(rest[: request.max_tokens]):
            if answer.delay_s:
                await asyncio.sleep(answer.delay_s)
            await self._unpaused()
            last = index + 1 == min(len(rest), request.max_tokens)
            finish: FinishReason | None = "stop" if token in stops else "length" if last else None
            yield TokenStep(token, 0.0, finish)
            if finish is not None:
                return
