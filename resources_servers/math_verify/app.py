"""math_verify: the reward is 1.0 when the final answer equals ``expected_answer`` mathematically.

Grading uses the ``math-verify`` library (``parse`` both sides, ``verify``) in worker processes
under a deadline (``grader.py``), so a pathological answer costs at most ``timeout_s`` and never
hangs the server; such an answer gets reward 0.0 and ``grade_status: timeout``. Only the last
``max_answer_chars`` characters of the final text are read (the answer comes last). Stateless, and
verify may simply run again.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated

from fastapi import FastAPI
from pydantic import Field, StrictFloat, StrictInt

from nemo_gym_ckpt.bounds import MAX_INT64
from nemo_gym_ckpt.config import ServerConfig
from nemo_gym_ckpt.context import ServerContext
from nemo_gym_ckpt.resources.base import ResourcesServer, Verdict, VerifyRequest, final_text
from nemo_gym_ckpt.server import close_on_shutdown
from resources_servers.math_verify.grader import GraderPool, GradeStatus

__all__ = ["Config", "MathVerify", "MathVerifyTask", "MathVerifyVerdict", "create_app"]

ExpectedText = Annotated[str, Field(strict=True, min_length=1, max_length=10_000)]


class Config(ServerConfig):
    timeout_s: float = Field(5.0, gt=0, le=600)
    workers: int = Field(2, ge=1, le=64)
    max_answer_chars: int = Field(4000, ge=1, le=1_000_000)


class MathVerifyTask(VerifyRequest):
    expected_answer: ExpectedText | Annotated[StrictInt, Field(ge=-MAX_INT64 - 1, le=MAX_INT64)] | Annotated[
        StrictFloat, Field(ge=-1e300, le=1e300)]


class MathVerifyVerdict(Verdict):
    extracted_answer: str | None
    grade_status: GradeStatus


class MathVerify(ResourcesServer[Config]):
    checkpoint_mode = "stateless"
    checkpoint_verify = "replay"

    def __init__(self, ctx: ServerContext[Config]) -> None:
        super().__init__(ctx)
        self.grader = GraderPool(self.settings.workers, self.settings.timeout_s)

    async def verify(self, task: MathVerifyTask) -> MathVerifyVerdict:
        text = (final_text(task.response) or "")[-self.settings.max_answer_chars :]
        grade = await self.grader.grade(str(task.expected_answer), text)
        return MathVerifyVerdict(
            reward=1.0 if grade.correct else 0.0, extracted_answer=grade.extracted, grade_status=grade.status
        )

    @asynccontextmanager
    async def lifespan(self, app: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            await self.grader.aclose()


def create_app(ctx: ServerContext[Config]) -> FastAPI:
    return close_on_shutdown(MathVerify(ctx).build_app(), ctx.aclose)
