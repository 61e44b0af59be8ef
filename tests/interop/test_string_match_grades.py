"""Our string_match grades NeMo Gym's rows (``extraction_mode``) as NeMo Gym 0.7.0's string_match does.

A table of answers, each extracted and graded by NeMo Gym's own string_match functions (in its
Python) and by ours (``resources_servers/string_match/answers.py``): the rewards and the extracted
answers must be the same. The table covers every extraction mode and every normalisation ours
claims; what NeMo Gym's grader knows beyond them is listed in docs/nemo-gym.md.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from resources_servers.string_match.answers import extract, grade

pytestmark = pytest.mark.interop

CASES: list[tuple[str, str, str, bool]] = [
    ("The capital of France is \\(\\boxed{\\text{Paris}}\\).", "boxed", "Paris", False),
    ("\\boxed{1} then \\boxed{ {2} }", "boxed", "{2}", False),
    ("\\boxed{open", "boxed", "open", False),
    ("no box here", "boxed", "x", False),
    ("Reasoning...\nFinal answer: Saturn.", "final_answer", "saturn", False),
    ("Answer: 12\nanswer\uff1a 15", "final_answer", "15", False),
    ("so it is \\boxed{80}", "final_answer", "80", False),
    ("thinking\n\nPacific Ocean\n  \n", "last_line", "Pacific Ocean", False),
    ("  all of it  ", "full_response", "All of it", False),
    ("Final answer: \"Paris\"", "final_answer", "Paris!", False),
    ("Final answer: \"Paris\"!", "final_answer", "paris", False),
    ("Final answer: 80.0", "final_answer", "80", False),
    ("Final answer: $1,000", "final_answer", "1000", False),
    ("Final answer: 1,000", "final_answer", "1000", False),
    ("Final answer: 50\\%", "final_answer", "50", False),
    ("Final answer: \\textbf{x} and $y$", "final_answer", "x and y", False),
    ("Final answer: \\mathrm{H_2O}", "final_answer", "h_2o", False),
    ("Final answer: \uff30\uff41\uff52\uff49\uff53", "final_answer", "paris", False),  # full-width letters
    ("Final answer: Rome", "final_answer", "Paris", False),
    ("Final answer: 99.6", "final_answer", "100", False),
    ("Final answer: 90", "final_answer", "100", False),
    ("\\boxed{paris}", "boxed", "Paris", True),
    ("\\boxed{ Paris }", "boxed", "Paris ", True),
    ("Paris", "full_response", "", False),
]


def ours(text: str, mode: str, expected: str, case_sensitive: bool) -> list[Any]:
    extracted = extract(text.strip(), mode)  # type: ignore[arg-type]
    reward = grade(extracted, expected, case_sensitive) if extracted is not None and expected else 0.0
    return [reward, extracted]


def test_every_case_is_graded_as_nemo_gym_grades_it(ng_json: Any) -> None:
    cases = [{"text": text, "mode": mode, "expected": expected, "case_sensitive": sensitive}
             for text, mode, expected, sensitive in CASES]
    theirs = ng_json("string_match_grades.py", json.dumps(cases))
    assert [ours(*case) for case in CASES] == theirs
    assert {reward for reward, _ in theirs} == {0.0, 0.98, 1.0}, "the table holds matches, near numbers, misses"
