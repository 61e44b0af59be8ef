"""mcqa: multiple choice; the reward is 1.0 when the chosen letter is the task's answer.

The task row is NeMo Gym's mcqa row: ``options`` in its format, a list of one-key objects
``[{"A": "text"}, {"B": "text"}, ...]``, and ``expected_answer`` (a letter); its other fields
(``uuid``, ``metadata``, ``grading_mode``, ``template_metadata``) pass through. The chosen letter is
read from the final assistant text, first match wins: the letter in the last ``\\boxed{...}``; the
last "Answer: X" / "the answer is (X)"; the whole text being one letter ("B", "(B)", "B."); the last
"(X)"; the whole text being one option's text. Only letters of the task's options count. This is
one lenient reading for every row: ``grading_mode`` is not interpreted (docs/nemo-gym.md). Stateless,
and verify may simply run again.
"""

from __future__ import annotations

import re
import string
from collections.abc import Iterator
from typing import Annotated, Self

from fastapi import FastAPI
from pydantic import Field, model_validator

from nemo_gym_ckpt.bounds import MAX_TEXT
from nemo_gym_ckpt.config import ServerConfig
from nemo_gym_ckpt.context import ServerContext
from nemo_gym_ckpt.resources.base import ResourcesServer, Verdict, VerifyRequest, final_text
from nemo_gym_ckpt.server import close_on_shutdown

__all__ = ["Config", "Mcqa", "McqaTask", "McqaVerdict", "create_app", "extract_choice"]

# Possessive quantifiers, none next to another that can match the same characters: linear in the
# text (the former ``(?:\s*[:).][^{}]*)?\s*\}?\s*\}`` backtracked cubically on "\boxed{A: " and
# spaces). It matches what that one did, at the same places.
_BOXED = re.compile(r"\\boxed\{\s*+(?:\\text\{\s*+)?\(?([A-Z])\)?\s*+(?:[:).][^{}]*+)?\}(?:\s*+\})?")
_ANSWER_PHRASE = re.compile(r"(?i:\banswer(?:\s+is)?)[\s:*\-]*\(?([A-Z])\)?(?![A-Za-z])")
_LONE_LETTER = re.compile(r"^\(?([A-Z])[).:]?$")
_PAREN_LETTER = re.compile(r"\(([A-Z])\)")
_WHITESPACE = re.compile(r"\s+")


class Config(ServerConfig):
    pass


class McqaTask(VerifyRequest):
    options: list[dict[Annotated[str, Field(max_length=8)], Annotated[str, Field(max_length=MAX_TEXT)]]] = Field(
        min_length=1, max_length=26)
    """NeMo Gym's format: one object per option, its one key the letter."""
    expected_answer: Annotated[str, Field(max_length=MAX_TEXT)]

    @model_validator(mode="after")
    def _answer_is_an_option(self) -> Self:
        if any(len(option) != 1 for option in self.options):
            raise ValueError('each option is an object with one key, its letter: [{"A": "..."}, ...]')
        letters = self.lettered()
        if len(letters) != len(self.options):
            raise ValueError("option letters must be distinct")
        if any(len(key) != 1 or key not in string.ascii_uppercase for key in letters):
            raise ValueError(f"option keys must be single capital letters, got {sorted(letters)}")
        if self.expected_answer.strip().upper() not in letters:
            raise ValueError(f"expected_answer {self.expected_answer!r} is not one of {sorted(letters)}")
        return self

    def lettered(self) -> dict[str, str]:
        return {letter: text for option in self.options for letter, text in option.items()}


class McqaVerdict(Verdict):
    extracted_answer: str | None


def _squash(text: str) -> str:
    return _WHITESPACE.sub(" ", text).strip().casefold()


def _candidates(text: str, options: dict[str, str]) -> Iterator[str]:
    """Letters the text may choose, most explicit first."""
    yield from reversed(_BOXED.findall(text))
    yield from reversed(_ANSWER_PHRASE.findall(text))
    yield from _LONE_LETTER.findall(text.strip())
    yield from reversed(_PAREN_LETTER.findall(text))
    yield from (letter for letter, option in options.items() if _squash(option) == _squash(text))


def extract_choice(text: str, options: dict[str, str]) -> str | None:
    """The letter ``text`` chooses among ``options``, or None."""
    return next((letter for letter in _candidates(text, options) if letter in options), None)


class Mcqa(ResourcesServer[Config]):
    checkpoint_mode = "stateless"
    checkpoint_verify = "replay"

    async def verify(self, task: McqaTask) -> McqaVerdict:
        choice = extract_choice(final_text(task.response) or "", task.lettered())
        correct = choice is not None and choice == task.expected_answer.strip().upper()
        return McqaVerdict(reward=1.0 if correct else 0.0, extracted_answer=choice)


def create_app(ctx: ServerContext[Config]) -> FastAPI:
    return close_on_shutdown(Mcqa(ctx).build_app(), ctx.aclose)
