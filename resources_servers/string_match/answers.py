"""Answers the way NeMo Gym's string_match reads them: a row's ``extraction_mode`` and its grade.

- ``assistant_text``: the text of every assistant message of the response, joined by newlines.
- ``extract``: ``boxed`` (the last balanced ``\\boxed{...}``, ``\\text{...}`` wrappers removed),
  ``final_answer`` (the last ``Final answer: ...`` or ``Answer: ...``, trailing periods dropped;
  else as ``boxed``), ``last_line`` (the last non-empty line), ``full_response`` (all of it).
- ``grade``: case-sensitive, the stripped strings must be equal; otherwise 1.0 when the two agree
  after any one of these normalisations, in order: Unicode NFKC + one pair of outer quotes removed
  + lower case + trailing ``.!?`` removed; then as numbers (``$``, ``\\$``, ``\\%`` dropped; a number a
  float cannot hold, past its range or below its normal range, by its exact decimal value); then
  digit-group commas removed; then LaTeX text commands, math delimiters and ``$`` removed; else
  0.98 when both read as numbers (``$ £ € % ,`` dropped) within about 1% of each other.
  NeMo Gym's grader knows more (lists, US states, units): docs/nemo-gym.md lists what this one lacks.
"""

from __future__ import annotations

import math
import re
import sys
import unicodedata
from collections.abc import Callable, Mapping, Sequence
from decimal import MAX_EMAX, MIN_EMIN, Decimal, DivisionByZero, InvalidOperation, Overflow, localcontext
from typing import Any, Literal

__all__ = ["ExtractionMode", "assistant_text", "extract", "grade"]

ExtractionMode = Literal["boxed", "final_answer", "last_line", "full_response"]

_BOXED = "\\boxed{"
_TEXT = "\\text{"
_BRACES = re.compile(r"[{}]")
_ANSWER_LINE = re.compile("(?i)(?:final\\s+answer|answer)\\s*[:\uff1a]\\s*(.+)")  # a colon, or a full-width one
_DIGIT_GROUPS = re.compile(r"(\d),(\d)")
_LATEX_COMMANDS = ("boxed", "text", "textbf", "textit", "texttt", "mathrm", "mathbf", "mathit", "mathsf",
                   "mathbb", "mathcal", "emph", "url")


def assistant_text(output: Sequence[Mapping[str, Any]]) -> str:
    """Every assistant message's text (string content or each part's ``text``), one per line, stripped."""
    texts: list[str] = []
    for item in output:
        if item.get("type") != "message" or item.get("role") != "assistant":
            continue
        content = item.get("content")
        if isinstance(content, str):
            texts.append(content)
        elif isinstance(content, list):
            texts += [part["text"] for part in content if isinstance(part, dict) and isinstance(part.get("text"), str)]
    return "\n".join(texts).strip()


def extract(text: str, mode: ExtractionMode) -> str | None:
    """The answer ``mode`` finds in ``text``, or None."""
    return _EXTRACTORS[mode](text)


def _brace_pairs(text: str) -> dict[int, int]:
    """The index of each closed ``{`` in ``text`` -> the index of the ``}`` closing it (one pass)."""
    pairs: dict[int, int] = {}
    opened: list[int] = []
    for brace in _BRACES.finditer(text):
        if brace[0] == "{":
            opened.append(brace.start())
        elif opened:
            pairs[opened.pop()] = brace.start()
    return pairs


def _boxed(text: str) -> str | None:
    start = text.rfind(_BOXED)
    pairs = _brace_pairs(text) if start != -1 else {}
    while start != -1:
        inner = start + len(_BOXED)
        end = pairs.get(inner - 1)
        if end is not None:
            return _without_text_wrappers(text[inner:end].strip())
        start = text.rfind(_BOXED, 0, start)
    return None


def _without_text_wrappers(value: str) -> str:
    """``value`` (stripped) without the ``\\text{...}`` wrappers around all of it, each one's inside stripped.

    Index arithmetic, linear in ``value``: the regex it replaces (``\\\\text\\{\\s*(.*?)\\s*\\}``, full
    match) backtracked cubically on a wrapper of spaces.
    """
    start, end = 0, len(value)
    while end - start > len(_TEXT) and value.startswith(_TEXT, start, end) and value[end - 1] == "}":
        start, end = start + len(_TEXT), end - 1
        while start < end and value[start].isspace():
            start += 1
        while end > start and value[end - 1].isspace():
            end -= 1
    return value[start:end]


def _final_answer(text: str) -> str | None:
    found = _ANSWER_LINE.findall(text)
    if found:
        return str(found[-1]).strip().rstrip(".").strip()
    return _boxed(text)


def _last_line(text: str) -> str | None:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else None


def _full_response(text: str) -> str | None:
    return text.strip() or None


_EXTRACTORS: dict[str, Callable[[str], str | None]] = {
    "boxed": _boxed, "final_answer": _final_answer, "last_line": _last_line, "full_response": _full_response,
}


def grade(extracted: str, expected: str, case_sensitive: bool) -> float:
    """1.0 when ``extracted`` is ``expected``, 0.98 when they are near numbers (module docstring), else 0.0."""
    if case_sensitive:
        return 1.0 if extracted.strip() == expected.strip() else 0.0
    got, want = _plain(extracted), _plain(expected)
    for view in (_same, _as_number, _without_digit_groups, _without_latex):
        if view(got) == view(want):
            return 1.0
    return NEAR_REWARD if _closeness(got, want) > NEAR_REWARD else 0.0


NEAR_REWARD = 0.98
"""The reward of two numbers that are near but not equal (and how near: the closeness above it)."""


def _closeness(got: str, want: str) -> float:
    """``(1 - relative error) ** 2`` of the two as numbers (0.0 when either is not one); the error
    from their exact decimal values when a float cannot hold either (``1e400``, ``1e-400``)."""
    got, want = _bare_number(got), _bare_number(want)
    try:
        value, target = float(got), float(want)
    except ValueError:
        return 0.0
    if _float_holds(value) and _float_holds(target):
        error = abs(value - target) / max(abs(target), 1e-9)
    else:
        error = _decimal_error(got, want)
    return max(0.0, 1.0 - error) ** 2


def _float_holds(value: float) -> bool:
    return value == 0.0 or math.isnan(value) or sys.float_info.min <= abs(value) < math.inf


def _decimal_error(got: str, want: str) -> float:
    """The relative error of two numbers past a float's range (NaN where a decimal cannot hold them either)."""
    with localcontext() as context:
        context.prec, context.Emax, context.Emin = 28, MAX_EMAX, MIN_EMIN
        context.traps[InvalidOperation] = context.traps[Overflow] = context.traps[DivisionByZero] = False
        value, target = Decimal(got), Decimal(want)
        return float(abs(value - target) / max(abs(target), Decimal("1e-9")))


def _bare_number(text: str) -> str:
    for mark in ("\\%", "\\$", "$", "\u00a3", "\u20ac", "%", ","):
        text = text.replace(mark, "")
    return text.strip()


def _plain(text: str) -> str:
    text = unicodedata.normalize("NFKC", text)
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "\"'":
        text = text[1:-1]
    text = text.lower()
    return text.rstrip(".!?") or text


def _same(text: str) -> str:
    return text


def _as_number(text: str) -> str:
    """``text`` as a float's string; as its exact decimal value when a float cannot hold it."""
    cleaned = text.replace("\\%", "").replace("\\$", "").replace("$", "").strip()
    try:
        value = float(cleaned)
    except ValueError:
        return text
    if sys.float_info.min <= abs(value) < math.inf or math.isnan(value):
        return str(value)
    return _past_float_range(cleaned) or str(value)


def _past_float_range(number: str) -> str | None:
    """The exact value of a finite, non-zero ``number`` that a float turns into ``inf``, 0 or a
    subnormal (``1e400``, ``1e-400``): its digits without trailing zeros and its exponent, a form no
    float's string takes (the number itself where even a decimal cannot hold its exponent); else None."""
    try:
        exact = Decimal(number)
    except InvalidOperation:
        return number.strip()
    if not exact.is_finite() or exact.is_zero():
        return None
    sign, digits, exponent = exact.as_tuple()
    significant = "".join(map(str, digits)).rstrip("0")
    return f"{'-' if sign else ''}{significant}e{int(exponent) + len(digits) - len(significant)}"


def _without_digit_groups(text: str) -> str:
    return _DIGIT_GROUPS.sub(r"\1\2", text).replace("\\%", "%")


def _without_latex(text: str) -> str:
    for command in _LATEX_COMMANDS:
        text = _unwrap(text, f"\\{command}{{")
    for delimiter in ("\\(", "\\)", "\\[", "\\]", "$"):
        text = text.replace(delimiter, "")
    return " ".join(text.split())


def _unwrap(text: str, opening: str) -> str:
    """``text`` with every ``\\cmd{inner}`` replaced by ``inner`` (an unclosed one loses its ``\\cmd{``).

    One pass: each ``{`` is pushed (marked when it opens ``opening``), each ``}`` closes the last
    open one and is dropped with its marked opening.
    """
    if opening not in text:
        return text
    pieces: list[str] = []
    kept = 0  # text[kept:] is not yet in pieces
    opened: list[bool] = []  # the open braces, innermost last: True where it is an opening's
    for token in re.finditer(re.escape(opening) + "|[{}]", text):
        if token[0] == "{":
            opened.append(False)
            continue
        if token[0] == "}" and not (opened and opened.pop()):
            continue
        pieces.append(text[kept : token.start()])
        kept = token.end()
        if token[0] != "}":
            opened.append(True)
    pieces.append(text[kept:])
    return "".join(pieces)
