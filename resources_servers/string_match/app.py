"""string_match: the reward is 1.0 when the final assistant text matches the task's answer.

The final text and each expected answer are compared after whitespace normalisation (runs of
whitespace become one space, ends stripped). ``mode: exact`` wants equality, ``mode: substring``
wants the answer inside the text; ``case_sensitive: false`` folds case first. ``expected_answer``
may be one string or a list of accepted strings. Stateless, and verify may simply run again.

A row with NeMo Gym's ``extraction_mode`` (``boxed``, ``final_answer``, ``last_line``,
``full_response``) is graded as NeMo Gym's string_match grades it (``answers``): the answer is
extracted from all the assistant text, ``extracted_answer`` is what was extracted, and the row's
``case_sensitive`` (default false there) picks exact or normalised comparison. A row's
``case_sensitive`` also overrides the config's when the row has no ``extraction_mode``.
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
from resources_servers.string_match.answers import ExtractionMode, assistant_text, extract, grade

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
    extraction_mode: ExtractionMode | None = None
    case_sensitive: bool | None = None

    def accepted(self) -> list[str]:
        return [self.expected_answer] if isinstance(self.expected_answer, str) else self.expected_answer


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
        if task.extraction_mode is not None:
            return self.verify_as_nemo_gym(task, task.extraction_mode)
        text = final_text(task.response)
        settings = self.settings
        if task.case_sensitive is not None:
            settings = settings.model_copy(update={"case_sensitive": task.case_sensitive})
        matched = text is not None and any(text_matches(text, want, settings) for want in task.accepted())
        return StringMatchVerdict(reward=1.0 if matched else 0.0, extracted_answer=text)

    def verify_as_nemo_gym(self, task: StringMatchTask, mode: ExtractionMode) -> StringMatchVerdict:
        extracted = extract(assistant_text(task.response.output), mode)
        case_sensitive = bool(task.case_sensitive)
        reward = 0.0
        if extracted is not None:
            reward = max((grade(extracted, want, case_sensitive) for want in task.accepted() if want), default=0.0)
        return StringMatchVerdict(reward=reward, extracted_answer=extracted)


def create_app(ctx: ServerContext[Config]) -> FastAPI:
    return close_on_shutdown(StringMatch(ctx).build_app(), ctx.aclose)
