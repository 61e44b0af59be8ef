"""calculator_tools: ``add``, ``subtract`` and ``multiply`` on two integers, and an answer check.

Each tool takes ``{"a": <int>, "b": <int>}`` and answers the result as bare JSON number text
(``5141``): the model reads a tool's output verbatim, and the default model is trained on exactly
that. Verify finds the last "The answer is N." in the final assistant text and compares N with the
task's ``expected_answer`` numerically. Stateless, and verify may simply run again.
"""

from __future__ import annotations

import math
import re
from decimal import Decimal, InvalidOperation
from typing import Annotated

from fastapi import FastAPI
from pydantic import Field, StrictFloat, StrictInt, StrictStr, field_validator

from nemo_gym_ckpt.bounds import MAX_INT64
from nemo_gym_ckpt.context import ServerContext
from nemo_gym_ckpt.resources.base import (
    ResourcesConfig,
    ResourcesServer,
    ToolArgs,
    Verdict,
    VerifyRequest,
    final_text,
    tool,
)
from nemo_gym_ckpt.server import close_on_shutdown

__all__ = [
    "OPERAND_LIMIT",
    "CalculatorTask",
    "CalculatorTools",
    "CalculatorVerdict",
    "Config",
    "Operands",
    "create_app",
    "extract_answer",
]

OPERAND_LIMIT = 10**15
_ANSWER = re.compile(r"the answer is\s*(-?\d+(?:,\d{3})*(?:\.\d+)?)", re.IGNORECASE)

Operand = Annotated[int, Field(strict=True, ge=-OPERAND_LIMIT, le=OPERAND_LIMIT)]


class Config(ResourcesConfig):
    pass


class Operands(ToolArgs):
    a: Operand
    b: Operand


class CalculatorTask(VerifyRequest):
    expected_answer: Annotated[StrictInt, Field(ge=-MAX_INT64 - 1, le=MAX_INT64)] | Annotated[
        StrictFloat, Field(ge=-1e300, le=1e300)] | Annotated[StrictStr, Field(max_length=1000)]

    @field_validator("expected_answer")
    @classmethod
    def _numeric(cls, value: float | str) -> float | str:
        _to_decimal(str(value))
        return value


class CalculatorVerdict(Verdict):
    extracted_answer: int | float | str | None
    """N as a JSON number; its exact decimal text where no JSON number holds it (``_as_json_number``)."""


def _to_decimal(text: str) -> Decimal:
    try:
        number = Decimal(text.replace(",", "").strip())
    except InvalidOperation:
        raise ValueError(f"{text!r} is not a number") from None
    if not number.is_finite():
        raise ValueError(f"{text!r} is not a finite number")
    return number


def extract_answer(text: str) -> Decimal | None:
    """The number of the last "The answer is N" in ``text``, or None."""
    matches = _ANSWER.findall(text)
    return _to_decimal(matches[-1]) if matches else None


def _as_json_number(number: Decimal) -> int | float | str:
    """``number`` for the reply: an integer of 64 bits as an int, another number as a float when it
    is finite, else (an integer past 64 bits, which JSON writers refuse or round, or a number past a
    float's range) its exact decimal text."""
    if number == number.to_integral_value():
        if -MAX_INT64 - 1 <= number <= MAX_INT64:
            return int(number)
        return format(number.to_integral_value(), "f")
    as_float = float(number)
    return as_float if math.isfinite(as_float) else format(number, "f")


class CalculatorTools(ResourcesServer[Config]):
    checkpoint_mode = "stateless"
    checkpoint_verify = "replay"

    @tool
    async def add(self, args: Operands) -> int:
        """Return a + b."""
        return args.a + args.b

    @tool
    async def subtract(self, args: Operands) -> int:
        """Return a - b."""
        return args.a - args.b

    @tool
    async def multiply(self, args: Operands) -> int:
        """Return a * b."""
        return args.a * args.b

    async def verify(self, task: CalculatorTask) -> CalculatorVerdict:
        found = extract_answer(final_text(task.response) or "")
        correct = found is not None and found == _to_decimal(str(task.expected_answer))
        extracted = _as_json_number(found) if found is not None else None
        return CalculatorVerdict(reward=1.0 if correct else 0.0, extracted_answer=extracted)


def create_app(ctx: ServerContext[Config]) -> FastAPI:
    return close_on_shutdown(CalculatorTools(ctx).build_app(), ctx.aclose)
