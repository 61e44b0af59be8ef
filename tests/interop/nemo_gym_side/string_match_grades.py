"""NeMo Gym 0.7.0's string_match extraction and grading on given texts (run by the interop tier's Python).

usage: python string_match_grades.py CASES_JSON
CASES_JSON is a JSON list of ``{"text", "mode", "expected", "case_sensitive"}``. Prints one JSON line:
a list of ``[reward, extracted_answer]``, one per case, as NeMo Gym's string_match verify computes them
(extraction from the assistant text, then the grade when something was extracted).
"""

from __future__ import annotations

import json
import sys

from resources_servers.string_match import app


def verdict(case: dict[str, object]) -> list[object]:
    extracted = app._extract_answer(str(case["text"]).strip(), str(case["mode"]))
    reward = 0.0
    if extracted is not None and case["expected"]:
        reward = app._answers_match(extracted, str(case["expected"]), bool(case["case_sensitive"]))
    return [reward, extracted]


if __name__ == "__main__":
    sys.stdout.write(json.dumps([verdict(case) for case in json.loads(sys.argv[1])]) + "\n")
