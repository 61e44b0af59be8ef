"""string_match: the reward is 1.0 when the final assistant text matches the task's answer.

The final text and each expected answer are compared after whitespace normalisation (runs of
whitespace become one space, ends stripped). ``mode: exact`` wants equality, ``mode: substring``
wants the answer inside the text; ``case_sensitive: false`` folds case first. ``expected_answer``
may be one string or a list of accepted strings. Stateless, and verify may simply run again.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from fastapi import FastAPI
from pydantic import Field

from nemo_gym_ckpt.bounds import MAX_TEXT
from nemo_gym_ckpt.config import ServerConfig
from nemo_gym_ckpt.context import ServerContext
from nemo_gym_ckpt.resources.base import ResourcesServer, Verdict, VerifyRequest, final_text
from nemo_gym_ckpt.server import close_on_shutdown

__all__ = [
    "Config",
    "StringMatch",
    "StringMatchTask",
    "StringMatchVerdict",
    "create_app",
    "normalize",
    "text_matches",
]

_WHITESPACE = re.compile(r"\s+")


class Config(ServerConfig):
    mode: Literal["exact", "substring"] = "exact"
    case_sensitive: bool = True


class StringMatchTask(VerifyRequest):
    expected_answer: Annotated[str, Field(max_length=MAX_TEXT)] | Annotated[
        list[Annotated[str, Field(max_length=MAX_TEXT)]], Field(max_length=1024)] = Field(min_length=1)


class StringMatchVerdict(Verdict):
    extracted_answer: str | None


def normalize(text: str, case_sensitive: bool) -> str:
    collapsed = _WHITESPACE.sub(" ", text).strip()
    return collapsed if case_sensitive else collapsed.casefold()


def text_matches(text: str, expected: str, settings: Config) -> bool:
    got, want = normalize(text, settings.case_sensitive), normalize(expected, settings.case_sensitive)
    return want in got if settings.mode == "substring" else got == want


class StringMatch(ResourcesServer[Config]):
    checkpoint_mode = "stateless"
    checkpoint_verify = "replay"

    async def verify(self, task: StringMatchTask) -> StringMatchVerdict:
        text = final_text(task.response)
        accepted = [task.expected_answer] if isinstance(task.expected_answer, str) else task.expected_answer
        matched = text is not None and any(text_matches(text, want, self.settings) for want in accepted)
        return StringMatchVerdict(reward=1.0 if matched else 0.0, extracted_answer=text)


def create_app(ctx: ServerContext[Config]) -> FastAPI:
    return close_on_shutdown(StringMatch(ctx).build_app(), ctx.aclose)
