"""Rollout rows and the files of a collection, as NeMo Gym 0.7's collector writes them (docs/nemo-gym.md).

A rollout is one dispatch of one task row: id ``"{task_index}-{rollout_index}"``. ``Stamps`` are
what the collector puts on every row besides the indices: the environment server's name
(``_ng_environment_server``), its implementation (``_ng_result_type``) and the agent it fronts
(``agent_ref``, unless the task row names its own). Files, for an output path ``out.jsonl``:

- ``out_materialized_inputs.jsonl``: every rollout of the collection as it is dispatched
  (``dispatch_row``: the task row, ``agent_ref``, ``_ng_task_index``, ``_ng_rollout_index``),
  written before the first ``/run``;
- ``out.jsonl``: one row per finished rollout (``output_row``): the environment's reply (the task
  row, ``response``, ``reward``, the verifier's fields) plus ``_ng_task_index``,
  ``_ng_rollout_index``, ``agent_ref``, ``_ng_attempt_index``, ``_ng_environment_server`` and
  ``_ng_result_type``;
- ``out_failures.jsonl``: one row per failed ``/run`` (``failure_row``): ``_ng_failure_class``
  (``agent_run_error`` when the environment answered and said no, ``agent_request_failed`` when it
  answered 429/502/503/504 or not at all), ``_ng_failure_type`` (the error's class),
  ``_ng_failure_message``, ``_ng_failure_http_status`` (or null), ``_ng_failure_response_body``
  (the reply, cut to 2,000 characters, or null), then the stamps; no task fields and no reward. A
  reply that carries ``_ng_failure_class`` itself is kept as it is, stamped, in this file too;
- ``out_aggregate_metrics.json``: a list with one entry per environment server: ``agent_ref``
  (``{"name"}``), ``_ng_environment_server`` and NeMo Gym's ``AggregateMetrics`` fields over the
  output rows (``nemo_gym_ckpt.aggregate_metrics``).

``summarize`` is the short summary the collector prints (mean reward and the means of every numeric
field the rollouts added). ``compare_rows`` says whether two collections of the same tasks produced
the same rows (what an interrupted and restored run must give against an uninterrupted one).

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

from nemo_gym_ckpt.aggregate_metrics import aggregate_metrics
from nemo_gym_ckpt.capture import GENERATION_LOG_PROBS, TOKEN_ARRAYS
from nemo_gym_ckpt.checkpoint.fileops import FileOps, require_regular
from nemo_gym_ckpt.errors import GymError

__all__ = [
    "AGENT_REQUEST_FAILED",
    "AGENT_RUN_ERROR",
    "FAILURE_BODY_CHARS",
    "LOGPROB_TOLERANCE",
    "JsonlAppender",
    "RolloutKey",
    "RowComparison",
    "RunFailure",
    "Stamps",
    "aggregate_entry",
    "compare_rows",
    "dispatch_body",
    "dispatch_row",
    "failure_row",
    "failures_path",
    "materialized_path",
    "metrics_path",
    "output_row",
    "read_jsonl",
    "rollout_id",
    "rollout_key",
    "summarize",
]

RolloutKey = tuple[int, int]
LOGPROB_TOLERANCE = 1e-4
AGENT_RUN_ERROR = "agent_run_error"
"""The environment answered the ``/run`` with an error: the rollout ran and broke."""
AGENT_REQUEST_FAILED = "agent_request_failed"
"""No answer, or a gateway status (429, 502, 503, 504): nothing says the rollout ran."""
FAILURE_BODY_CHARS = 2000
_GATEWAY_STATUSES = frozenset({429, 502, 503, 504})
_LOGPROBS = GENERATION_LOG_PROBS
_TOKEN_ARRAYS = frozenset(TOKEN_ARRAYS)
_UNCOMPARED = frozenset({"created_at", "_ng_attempt_index"}) | _TOKEN_ARRAYS
TASK_INDEX, ROLLOUT_INDEX, ATTEMPT_INDEX = "_ng_task_index", "_ng_rollout_index", "_ng_attempt_index"
AGENT_REF, ENVIRONMENT_SERVER, RESULT_TYPE = "agent_ref", "_ng_environment_server", "_ng_result_type"
FAILURE_CLASS = "_ng_failure_class"
_OPS = FileOps()


def rollout_id(task_index: int, rollout_index: int) -> str:
    return f"{task_index}-{rollout_index}"


def _sibling(output: Path, suffix: str) -> Path:
    stem = output.name.removesuffix(".jsonl")
    return output.with_name(stem + suffix)


def failures_path(output: Path) -> Path:
    return _sibling(output, "_failures.jsonl")


def metrics_path(output: Path) -> Path:
    return _sibling(output, "_aggregate_metrics.json")


def materialized_path(output: Path) -> Path:
    return _sibling(output, "_materialized_inputs.jsonl")


@dataclass(frozen=True)
class Stamps:
    """What every row of one environment server carries besides its indices."""

    environment: str
    """The environment server's instance name (``_ng_environment_server``)."""
    result_type: str | None = None
    """Its implementation (``_ng_result_type``), e.g. ``single_agent_turn``."""
    agent_ref: Mapping[str, Any] | None = None
    """The agent it fronts, as a ``{type, name}`` reference; a task row's own ``agent_ref`` wins."""

    def fields(self) -> dict[str, Any]:
        stamps: dict[str, Any] = {ENVIRONMENT_SERVER: self.environment}
        if self.result_type is not None:
            stamps[RESULT_TYPE] = self.result_type
        return stamps


def dispatch_row(task: Mapping[str, Any], task_index: int, rollout_index: int, stamps: Stamps) -> dict[str, Any]:
    """A rollout as dispatched (its line of the materialized inputs): the task row, ``agent_ref``, indices."""
    row = dict(task)
    if AGENT_REF not in row and stamps.agent_ref is not None:
        row[AGENT_REF] = dict(stamps.agent_ref)
    row[TASK_INDEX], row[ROLLOUT_INDEX] = task_index, rollout_index
    return row


def dispatch_body(dispatched: Mapping[str, Any], attempt: int) -> dict[str, Any]:
    """The ``/run`` body of one attempt: the dispatched row, with ``_ng_attempt_index`` from attempt 1 on."""
    return {**dispatched, ATTEMPT_INDEX: attempt} if attempt else dict(dispatched)


def _row_stamps(dispatched: Mapping[str, Any], attempt: int, stamps: Stamps) -> dict[str, Any]:
    found: dict[str, Any] = {TASK_INDEX: dispatched[TASK_INDEX], ROLLOUT_INDEX: dispatched[ROLLOUT_INDEX]}
    if AGENT_REF in dispatched:
        found[AGENT_REF] = dispatched[AGENT_REF]
    found[ATTEMPT_INDEX] = attempt
    return {**found, **stamps.fields()}


def output_row(
    reply: Mapping[str, Any], dispatched: Mapping[str, Any], attempt: int, stamps: Stamps
) -> dict[str, Any]:
    """A finished rollout's row: the reply, then the collector's keys (a reply's own value is replaced)."""
    return {**reply, **_row_stamps(dispatched, attempt, stamps)}


@dataclass(frozen=True)
class RunFailure:
    """A ``/run`` that came back without a row: the error, and the reply's status and body if any."""

    error: GymError
    status: int | None = None
    body: bytes | None = None

    @property
    def failure_class(self) -> str:
        answered = self.status is not None and self.status not in _GATEWAY_STATUSES
        return AGENT_RUN_ERROR if answered else AGENT_REQUEST_FAILED


def _cut_body(body: bytes | None) -> str | None:
    if not body:
        return None
    text = body[: FAILURE_BODY_CHARS * 4].decode("utf-8", "replace")
    return text[:FAILURE_BODY_CHARS] + ("…" if len(body) > FAILURE_BODY_CHARS else "")


def failure_row(failure: RunFailure, dispatched: Mapping[str, Any], attempt: int, stamps: Stamps) -> dict[str, Any]:
    """A failed ``/run``'s row for the failures file: NeMo Gym's failure fields, then the stamps."""
    fields = {
        FAILURE_CLASS: failure.failure_class,
        "_ng_failure_type": type(failure.error).__name__,
        "_ng_failure_message": failure.error.detail,
        "_ng_failure_http_status": failure.status,
        "_ng_failure_response_body": _cut_body(failure.body),
    }
    return {**fields, **_row_stamps(dispatched, attempt, stamps)}


def aggregate_entry(rows: Iterable[Mapping[str, Any]], stamps: Stamps) -> dict[str, Any]:
    """One environment server's entry of the aggregate metrics file (NeMo Gym's layout)."""
    metrics = aggregate_metrics(list(rows))
    label = stamps.agent_ref.get("name") if stamps.agent_ref is not None else None
    entry: dict[str, Any] = {
        AGENT_REF: {"name": label if isinstance(label, str) else stamps.environment},
        ENVIRONMENT_SERVER: stamps.environment,
        **{name: metrics[name] for name in ("agent_metrics", "key_metrics", "group_level_metrics",
                                             "repeat_level_metrics")},
    }
    if metrics["perf_summary"] is not None:
        entry["perf_summary"] = metrics["perf_summary"]
    return entry


def rollout_key(row: Mapping[str, Any]) -> RolloutKey | None:
    """The (task, rollout) indices of an output row, if it has them."""
    task, rollout = row.get("_ng_task_index"), row.get("_ng_rollout_index")
    if isinstance(task, int) and isinstance(rollout, int):
        return task, rollout
    return None


def read_jsonl(path: Path, *, complete_lines_only: bool = False) -> Iterator[dict[str, Any]]:
    """The JSON-object lines of a file (none if it is absent), read a line at a time; ``ValueError``
    names a bad line.

    With ``complete_lines_only`` a last line without its newline (a torn write) is skipped. Only a
    regular file is read (a symlink to one is followed): a FIFO, a device, a socket or a directory is
    ``NotRegularFile`` (an ``OSError``), found before anything is read, so nothing waits on a FIFO
    without a writer or reads ``/dev/zero`` without end.
    """
    try:
        file = _OPS.open_read(path, follow_symlinks=True)
    except FileNotFoundError:
        return
    with file:
        for number, line in enumerate(file, start=1):
            if complete_lines_only and not line.endswith(b"\n"):
                return  # only the last line can lack its newline
            if line.strip():
                yield _json_object(line, path, number)


def _json_object(line: bytes, path: Path, number: int) -> dict[str, Any]:
    try:
        row = orjson.loads(line)
    except orjson.JSONDecodeError:
        row = None
    if not isinstance(row, dict):
        raise ValueError(f"{path}, line {number}: not a JSON object")
    return row


class JsonlAppender:
    """Appends JSON rows to a file, one ``write`` per row; cuts a torn tail off at open. The path
    must be a regular file or absent (``NotRegularFile`` else, found by a non-blocking open)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
        try:
            require_regular(self._fd, path)
            os.set_blocking(self._fd, True)
            self._cut_torn_tail()
        except BaseException:
            self.close()
            raise

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


def summarize(
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

    ``token_arrays_compared``: model outputs whose token arrays both rows carry (ids compared
    exactly, logprobs within the tolerance); ``token_arrays_absent``: outputs whose token arrays only
    one of the two rows carries. Each of those makes its rollout differ: a restored rollout must
    give its trainer the same training data as an uninterrupted one.
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
        """Token arrays on the same objects of both rows: ids equal, logprobs within the tolerance.

        An object carrying token arrays in one row only is a difference (counted in ``absent``):
        a row without the training data of a call is not the same row."""
        mine, reference = dict(_token_holders(ours)), dict(_token_holders(theirs))
        one_sided = mine.keys() ^ reference.keys()
        self.absent += len(one_sided)
        same = not one_sided
        for path in mine.keys() & reference.keys():
            self.compared += 1
            same = self._same_arrays(mine[path], reference[path]) and same
        return same

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
    ``_ng_attempt_index``; the same objects carrying token arrays, their ids equal and their logprobs
    within ``logprob_tolerance`` (batching moves their last bits)."""
    ours = {key: row for row in rows if (key := rollout_key(row)) is not None}
    theirs = {key: row for row in reference if (key := rollout_key(row)) is not None}
    tally = _TokenTally(tolerance=logprob_tolerance)
    both = sorted(ours.keys() & theirs.keys())
    differing = [key for key in both if _comparable(ours[key]) != _comparable(theirs[key])
                 or not tally.same(ours[key], theirs[key])]
    return RowComparison(len(both), differing, sorted(theirs.keys() - ours.keys()),
                         sorted(ours.keys() - theirs.keys()), tally.worst, tally.compared, tally.absent)
