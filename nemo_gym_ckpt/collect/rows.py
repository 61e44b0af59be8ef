"""Rollout rows and the files of a collection (docs/architecture.md section 7).

A rollout is one dispatch of one task row: id ``"{task_index}-{rollout_index}"``. Files, for an
output path ``out.jsonl``:

- ``out.jsonl``: one row per finished rollout: the environment's reply (the task row, ``response``,
  ``reward``, the verifier's fields) plus ``_ng_task_index``, ``_ng_rollout_index`` and
  ``_ng_attempt_index``;
- ``out_failures.jsonl``: the task row, the same ``_ng_`` fields, ``_ng_failure_class`` (the error
  code) and ``_ng_failure_reason``;
- ``out_aggregate_metrics.json``: ``aggregate`` over the output rows.

``compare_rows`` says whether two collections of the same tasks produced the same rows (what an
interrupted and restored run must give against an uninterrupted one).

``JsonlAppender`` appends each row with a single ``write`` on a file opened ``O_APPEND``, so a row
is on disk whole or not at all as far as readers of this process go; a tail torn by a crash (a
last line without its newline) is cut off when the file is opened again, so it is never kept.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from nemo_gym_ckpt.capture import GENERATION_LOG_PROBS, TOKEN_ARRAYS

__all__ = [
    "LOGPROB_TOLERANCE",
    "JsonlAppender",
    "RolloutKey",
    "RowComparison",
    "aggregate",
    "compare_rows",
    "failure_row",
    "failures_path",
    "metrics_path",
    "output_row",
    "read_jsonl",
    "rollout_id",
    "rollout_key",
]

RolloutKey = tuple[int, int]
LOGPROB_TOLERANCE = 1e-4
_LOGPROBS = GENERATION_LOG_PROBS
_TOKEN_ARRAYS = frozenset(TOKEN_ARRAYS)
_UNCOMPARED = frozenset({"created_at", "_ng_attempt_index"}) | _TOKEN_ARRAYS


def rollout_id(task_index: int, rollout_index: int) -> str:
    return f"{task_index}-{rollout_index}"


def _sibling(output: Path, suffix: str) -> Path:
    stem = output.name.removesuffix(".jsonl")
    return output.with_name(stem + suffix)


def failures_path(output: Path) -> Path:
    return _sibling(output, "_failures.jsonl")


def metrics_path(output: Path) -> Path:
    return _sibling(output, "_aggregate_metrics.json")


def _ng_fields(task_index: int, rollout_index: int, attempt: int) -> dict[str, int]:
    return {"_ng_task_index": task_index, "_ng_rollout_index": rollout_index, "_ng_attempt_index": attempt}


def output_row(
    reply: Mapping[str, Any], task_index: int, rollout_index: int, attempt: int = 0
) -> dict[str, Any]:
    return {**reply, **_ng_fields(task_index, rollout_index, attempt)}


def failure_row(
    task: Mapping[str, Any], task_index: int, rollout_index: int, code: str, reason: str, attempt: int = 0
) -> dict[str, Any]:
    return {**task, **_ng_fields(task_index, rollout_index, attempt),
            "_ng_failure_class": code, "_ng_failure_reason": reason}


def rollout_key(row: Mapping[str, Any]) -> RolloutKey | None:
    """The (task, rollout) indices of an output row, if it has them."""
    task, rollout = row.get("_ng_task_index"), row.get("_ng_rollout_index")
    if isinstance(task, int) and isinstance(rollout, int):
        return task, rollout
    return None


def read_jsonl(path: Path, *, complete_lines_only: bool = False) -> Iterator[dict[str, Any]]:
    """The JSON-object lines of a file (none if it is absent); ``ValueError`` names a bad line.

    With ``complete_lines_only`` a last line without its newline (a torn write) is skipped.
    """
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return
    lines = data.split(b"\n")
    if complete_lines_only and not data.endswith(b"\n"):
        lines = lines[:-1]
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = orjson.loads(line)
        except orjson.JSONDecodeError:
            row = None
        if not isinstance(row, dict):
            raise ValueError(f"{path}, line {number}: not a JSON object")
        yield row


class JsonlAppender:
    """Appends JSON rows to a file, one ``write`` per row; cuts a torn tail off at open."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        self._cut_torn_tail()

    def _cut_torn_tail(self) -> None:
        size = os.fstat(self._fd).st_size
        if size == 0 or os.pread(self._fd, 1, size - 1) == b"\n":
            return
        data = os.pread(self._fd, size, 0)
        os.ftruncate(self._fd, data.rfind(b"\n") + 1)

    def append(self, row: Mapping[str, Any]) -> None:
        line = orjson.dumps(row, option=orjson.OPT_NON_STR_KEYS) + b"\n"
        written = os.write(self._fd, line)
        if written != len(line):
            raise OSError(f"short write to {self.path}: {written} of {len(line)} bytes")

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> JsonlAppender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _numbers(row: Mapping[str, Any], skip: set[str]) -> Iterator[tuple[str, float]]:
    for key, value in row.items():
        if key in skip or key.startswith("_ng_"):
            continue
        if isinstance(value, bool | int | float) and math.isfinite(value):
            yield key, float(value)
    usage = row.get("response", {}).get("usage") if isinstance(row.get("response"), dict) else None
    for key, value in (usage or {}).items():
        if isinstance(value, int | float) and not isinstance(value, bool):
            yield f"usage.{key}", float(value)


def aggregate(
    rows: Iterable[Mapping[str, Any]], task_fields: Iterable[str] = (), failures: int = 0
) -> dict[str, Any]:
    """Mean reward and the mean of every numeric field the rollouts added (task fields left out)."""
    skip = set(task_fields)
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    total = 0
    for row in rows:
        total += 1
        for key, value in _numbers(row, skip):
            sums[key] = sums.get(key, 0.0) + value
            counts[key] = counts.get(key, 0) + 1
    means = {key: sums[key] / counts[key] for key in sorted(sums)}
    return {"rollouts": total, "failures": failures, "mean_reward": means.get("reward"), "means": means}


# ---- comparing two collections -------------------------------------------------------------------


@dataclass(frozen=True)
class RowComparison:
    """How the rows of a run compare with a reference run's.

    ``token_arrays_compared``: model outputs whose token ids both rows carry (compared exactly, with
    their logprobs within the tolerance); ``token_arrays_absent``: outputs whose token arrays only the
    reference carries (a rollout continued from a checkpoint has none for its earlier calls: records
    never carry token arrays, the trainer got them when the calls were made).
    """

    compared: int
    differing: list[RolloutKey]
    missing: list[RolloutKey]
    extra: list[RolloutKey]
    max_logprob_diff: float
    token_arrays_compared: int = 0
    token_arrays_absent: int = 0

    @property
    def identical(self) -> bool:
        return not (self.differing or self.missing or self.extra)


def _comparable(value: Any) -> Any:
    """``value`` without timestamps, attempt indices and token arrays (compared apart)."""
    if isinstance(value, dict):
        return {key: _comparable(item) for key, item in value.items() if key not in _UNCOMPARED}
    if isinstance(value, list):
        return [_comparable(item) for item in value]
    return value


def _token_holders(value: Any, path: str = "") -> Iterator[tuple[str, Mapping[str, Any]]]:
    """Every object carrying token arrays, with its path."""
    if isinstance(value, dict):
        if _TOKEN_ARRAYS & value.keys():
            yield path, value
        for key, item in value.items():
            yield from _token_holders(item, f"{path}/{key}")
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _token_holders(item, f"{path}[{index}]")


@dataclass
class _TokenTally:
    tolerance: float = LOGPROB_TOLERANCE
    compared: int = 0
    absent: int = 0
    worst: float = 0.0

    def same(self, ours: Mapping[str, Any], theirs: Mapping[str, Any]) -> bool:
        """Token arrays where both rows have them: ids equal, logprobs within the tolerance."""
        mine, reference = dict(_token_holders(ours)), dict(_token_holders(theirs))
        if mine.keys() - reference.keys():
            return False
        self.absent += len(reference.keys() - mine.keys())
        for path in mine:
            self.compared += 1
            if not self._same_arrays(mine[path], reference[path]):
                return False
        return True

    def _same_arrays(self, ours: Mapping[str, Any], theirs: Mapping[str, Any]) -> bool:
        exact = {key: ours.get(key) for key in _TOKEN_ARRAYS - {_LOGPROBS}}
        if exact != {key: theirs.get(key) for key in _TOKEN_ARRAYS - {_LOGPROBS}}:
            return False
        first, second = ours.get(_LOGPROBS) or [], theirs.get(_LOGPROBS) or []
        if len(first) != len(second):
            return False
        diff = max((abs(float(x) - float(y)) for x, y in zip(first, second, strict=True)), default=0.0)
        self.worst = max(self.worst, diff)
        return diff <= self.tolerance


def compare_rows(
    reference: Iterable[Mapping[str, Any]], rows: Iterable[Mapping[str, Any]],
    *, logprob_tolerance: float = LOGPROB_TOLERANCE,
) -> RowComparison:
    """Rows equal to the reference's, key by key: every field but ``created_at`` and
    ``_ng_attempt_index``; token ids equal and logprobs within ``logprob_tolerance`` (batching moves
    their last bits) wherever both rows carry them."""
    ours = {key: row for row in rows if (key := rollout_key(row)) is not None}
    theirs = {key: row for row in reference if (key := rollout_key(row)) is not None}
    tally = _TokenTally(tolerance=logprob_tolerance)
    both = sorted(ours.keys() & theirs.keys())
    differing = [key for key in both if _comparable(ours[key]) != _comparable(theirs[key])
                 or not tally.same(ours[key], theirs[key])]
    return RowComparison(len(both), differing, sorted(theirs.keys() - ours.keys()),
                         sorted(ours.keys() - theirs.keys()), tally.worst, tally.compared, tally.absent)
