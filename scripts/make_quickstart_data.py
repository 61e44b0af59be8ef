"""Write the quickstart task file: calculator word problems for the embedded default model.

    .venv/bin/python scripts/make_quickstart_data.py [--rows 200] [--seed 20260]
        [--out resources_servers/calculator_tools/data/quickstart.jsonl]

Each row is one problem from ``default_model_data.make_problem`` drawn from ``random.Random(seed)``
(default 20260: neither the training seed 0 nor the evaluation seed 12345 of
``build_default_model.py``). Questions are held out: none repeats, and none is one of the default
model's training questions (the first ``--train-examples`` problems of ``random.Random(--train-seed)``,
by default the build's 8000 steps x 32 from seed 0), so the quickstart reward measures
generalisation. A row is a NeMo Gym task row: the question as the user message, the three
calculator tools in the Responses API shape (as calculator_tools' ``GET /tools`` serves them),
``expected_answer``, and the problem's ``tool`` and ``template`` for slicing results. The same
arguments always write the same bytes.
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Set
from pathlib import Path
from typing import Any

import orjson

from model_servers.inference_worker.default_model_data import make_problem
from resources_servers.calculator_tools.app import CalculatorTools

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "resources_servers/calculator_tools/data/quickstart.jsonl"


def task_row(index: int, problem: dict[str, Any], tools: list[dict[str, Any]]) -> dict[str, Any]:
    messages = [{"role": "user", "content": problem["question"]}]
    return {
        "responses_create_params": {"input": messages, "tools": tools},
        "expected_answer": problem["answer"],
        "task_id": f"quickstart-{index:04d}",
        "tool": problem["tool"],
        "template": problem["template"],
    }


def training_questions(seed: int, count: int) -> set[str]:
    """The questions the default model was trained on (the build draws them the same way)."""
    rng = random.Random(seed)
    return {make_problem(rng)["question"] for _ in range(count)}


def make_rows(count: int, seed: int, exclude: Set[str] = frozenset()) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    tools = [spec.definition() for spec in CalculatorTools.tool_specs.values()]
    seen: set[str] = set(exclude)
    rows: list[dict[str, Any]] = []
    while len(rows) < count:
        problem = make_problem(rng)
        if problem["question"] not in seen:
            seen.add(problem["question"])
            rows.append(task_row(len(rows), problem, tools))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=200)
    parser.add_argument("--seed", type=int, default=20260)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--train-seed", type=int, default=0)
    parser.add_argument("--train-examples", type=int, default=8000 * 32, help="0: exclude nothing")
    args = parser.parse_args()
    rows = make_rows(args.rows, args.seed, training_questions(args.train_seed, args.train_examples))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_bytes(b"".join(orjson.dumps(row) + b"\n" for row in rows))
    print(f"wrote {len(rows)} rows to {args.out}")


if __name__ == "__main__":
    main()
