"""mcqa: multiple choice; the reward is 1.0 when the chosen letter is the task's answer.

The task row carries ``options`` (a list, lettered A, B, C, ... in order, or a dict letter ->
text) and ``expected_answer`` (a letter). The chosen letter is read from the final assistant text,
first match wins: the last "Answer: X" / "the answer is (X)"; the whole text being one letter
("B", "(B)", "B."); the last "(X)"; the whole text being one option's text. Only letters of the
task's options count. Stateless, and verify may simply run again.
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

_ANSWER_PHRASE = re.compile(r"(?i:\banswer(?:\s+is)?)[\s:*\-]*\(?([A-Z])\)?(?![A-Za-z])")
_LONE_LETTER = re.compile(r"^\(?([A-Z])[).:]?$")
_PAREN_LETTER = re.compile(r"\(([A-Z])\)")
_WHITESPACE = re.compile(r"\s+")


class Config(ServerConfig):
    pass


Option = Annotated[str, Field(max_length=MAX_TEXT)]


class McqaTask(VerifyRequest):
    options: Annotated[list[Option], Field(max_length=26)] | dict[Annotated[str, Field(max_length=26)], Option] = (
        Field(min_length=1, max_length=26))
    expected_answer: Annotated[str, Field(max_length=MAX_TEXT)]

    @model_validator(mode="after")
    def _answer_is_an_option(self) -> Self:
        letters = self.lettered()
        if any(len(key) != 1 or key not in string.ascii_uppercase for key in letters):
            raise ValueError(f"option keys must be single capital letters, got {sorted(letters)}")
        if self.expected_answer.strip().upper() not in letters:
            raise ValueError(f"expected_answer {self.expected_answer!r} is not one of {sorted(letters)}")
        return self

    def lettered(self) -> dict[str, str]:
        if isinstance(self.options, dict):
            return self.options
        return dict(zip(string.ascii_uppercase, self.options, strict=False))


class McqaVerdict(Verdict):
    extracted_answer: str | None


def _squash(text: str) -> str:
    return _WHITESPACE.sub(" ", text).strip().casefold()


def _candidates(text: str, options: dict[str, str]) -> Iterator[str]:
    """Letters the text may choose, most explicit first."""
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
