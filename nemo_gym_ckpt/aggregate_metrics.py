"""Aggregate metrics in NeMo Gym 0.7's ``AggregateMetrics`` shape (docs/nemo-gym.md, "Rows and files").

``aggregate_metrics(verify_responses)`` answers ``POST /aggregate_metrics`` on the environment and
agent servers, and is what the collector writes per environment server into
``<output>_aggregate_metrics.json``. Its input is a list of finished rollout rows (each with
``_ng_task_index``, ``_ng_rollout_index`` and a numeric ``reward``); its answer has the five fields
of NeMo Gym's model:

- ``group_level_metrics``: one entry per task (sorted by task index): ``_ng_task_index``, the
  statistics of every numeric field (``mean/<f>``, ``max/<f>``, ``min/<f>``, ``median/<f>``,
  ``std/<f>``), ``sample``, ``num_rollouts``, ``expected_num_rollouts``, ``missing_num_rollouts``,
  ``reward_profile_completion_pct`` and ``rollout_infos`` (``rollout_id`` ``"<task>:<rollout>"``,
  the indices and the rollout's numeric fields);
- ``agent_metrics``: the same statistics over every rollout, with ``<stat>_across_repeats/mean/<f>``
  when there are several repeats, and ``num_repeats``;
- ``key_metrics``: the ``mean/`` entries of ``agent_metrics``;
- ``repeat_level_metrics``: with several repeats, one entry per rollout index: ``sample_count``,
  ``missing_count`` and per field mean, median, std, sem, min, max, p25, p75 and the 95% Student-t
  interval (``ci_low_95/<f>``, ``ci_high_95/<f>``);
- ``perf_summary``: ``None`` (this mesh has no per-rollout ``ng_perf`` records).

A numeric field is a top-level key not starting with ``_`` whose value is a finite number (a boolean
counts as 0 or 1; an integer past the float range is left out, like ``inf``), or a number in
``response.usage``. Standard deviations are sample deviations (n - 1); one value has none, except
that a group where no field has two values reports 0 for the fields every rollout carries (NeMo
Gym's rule). Rows with ``mask_sample: true`` are left out of every statistic and counted under
``coverage/...`` keys instead.

Values near the float limit never make it fail: means, medians and quantiles are taken so that they
cannot overflow (the mean of ``[1e308, 1e308]`` is ``1e308``), and a statistic whose value is past
the float range (the standard deviation of ``[1.7e308, -1.7e308]``, the interval built on it) is
``None``. NeMo Gym's pandas statistics overflow to ``inf`` there, which its JSON reply carries as
``null``: the same keys, with a finite mean where one exists.

``mount_aggregate_metrics(app)`` serves it: ``POST /aggregate_metrics`` with NeMo Gym's body
``{"verify_responses": [row, ...]}`` (at most ``MAX_VERIFY_RESPONSES`` rows; anything else is 400).
It starts no rollout work, so it never waits for a checkpoint.
"""

from __future__ import annotations

import math
import statistics
import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "AGGREGATE_FIELDS",
    "MAX_VERIFY_RESPONSES",
    "AggregateMetricsRequest",
    "aggregate_metrics",
    "mount_aggregate_metrics",
    "numeric_fields",
    "student_t_quantile",
]

MAX_VERIFY_RESPONSES = 1_000_000

AGGREGATE_FIELDS = ("group_level_metrics", "agent_metrics", "key_metrics", "perf_summary", "repeat_level_metrics")
TASK_INDEX = "_ng_task_index"
ROLLOUT_INDEX = "_ng_rollout_index"
MASK_SAMPLE = "mask_sample"
_BASIC_STATS = ("mean", "max", "min", "median", "std")
_NOT_REPEAT_AGGREGATED = ("max/", "min/", "median/", "std/", "sem/", "se/", "p25/", "p75/", "ci_low_95/",
                          "ci_high_95/", "histogram/")
_NOT_REPEAT_AGGREGATED_SUFFIXES = ("/max", "/min", "/median", "/p5", "/p25", "/p75", "/p95", "/ci_low_95",
                                   "/ci_high_95", "/ci_lower", "/ci_upper", "_ci_lower", "_ci_upper",
                                   "_ci95_lower", "_ci95_upper", "/_ng_attempt_index", "/std_dev_across_runs",
                                   "/std_err_across_runs", "/avg_sample_std_dev")
_NOT_METRICS = frozenset({TASK_INDEX, ROLLOUT_INDEX, "_ng_attempt_index", "sample_count", "missing_count",
                          "num_repeats", "token_usage_version"})

Numbers = dict[str, float | int]
Stats = dict[str, float | int | None]


def _number(value: Any) -> float | int | None:
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value if abs(value) <= sys.float_info.max else None
    if isinstance(value, float) and math.isfinite(value):
        return value
    return None


def _index(row: Mapping[str, Any], key: str) -> int:
    value = row.get(key, 0)
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def numeric_fields(row: Mapping[str, Any]) -> Numbers:
    """The fields statistics are taken over: top-level numbers (not ``_``-prefixed), then usage numbers."""
    response = row.get("response")
    usage = response.get("usage") if isinstance(response, dict) else None
    merged = {**row, **(usage if isinstance(usage, dict) else {})}
    found: Numbers = {}
    for key, value in merged.items():
        number = _number(value)
        if not key.startswith("_") and key != MASK_SAMPLE and number is not None:
            found[key] = number
    return found


def _rollout_info(row: Mapping[str, Any]) -> dict[str, Any]:
    task, rollout = _index(row, TASK_INDEX), _index(row, ROLLOUT_INDEX)
    info: dict[str, Any] = {"rollout_id": f"{task}:{rollout}", TASK_INDEX: task, ROLLOUT_INDEX: rollout}
    if "reward" in row:
        info["reward"] = row["reward"]
    response = row.get("response")
    usage = response.get("usage") if isinstance(response, dict) else None
    for key, value in (usage if isinstance(usage, dict) else {}).items():
        if (number := _number(value)) is not None:
            info[key] = number
    for key, value in row.items():
        if key.startswith("_") or key in ("reward", "response", MASK_SAMPLE):
            continue
        if (number := _number(value)) is not None:
            info[key] = number
    return info


def _columns(rows: Iterable[Numbers]) -> list[str]:
    seen: dict[str, None] = {}
    for row in rows:
        seen.update(dict.fromkeys(row))
    return list(seen)


def _mean(values: Sequence[float | int]) -> float:
    """The mean; finite for any finite values (``fmean``'s running sum overflows near the float limit)."""
    try:
        return statistics.fmean(values)
    except OverflowError:
        # scaled by a power of two at least the count (exact), the sum stays within the float range
        scale = max(len(values) - 1, 1).bit_length()
        scaled = math.fsum(math.ldexp(value, -scale) for value in values) / len(values)
        return min(max(math.ldexp(scaled, scale), min(values)), max(values))  # it lies between the extremes


def _median(values: Sequence[float | int]) -> float | int:
    """The median; finite for any finite values (the two middle ones halved first if their sum overflows)."""
    median = statistics.median(values)
    if math.isfinite(median):
        return median
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle - 1] / 2 + ordered[middle] / 2


def _stdev(values: Sequence[float | int]) -> float:
    """The sample standard deviation (n - 1); ``inf`` when it is past the float range."""
    try:
        return statistics.stdev(values)
    except OverflowError:
        return math.inf


def _sample_std(values: Sequence[float | int]) -> float | None:
    return _stdev(values) if len(values) > 1 else None


def _reported(stats: Mapping[str, float | int | None]) -> Stats:
    """``stats`` with every statistic that is not a finite float (past the float range) as ``None``."""
    return {name: None if isinstance(value, float) and not math.isfinite(value) else value
            for name, value in stats.items()}


def _describe(rows: Sequence[Numbers]) -> Stats:
    """``<stat>/<field>`` for every field of ``rows`` (NeMo Gym's per-group description)."""
    columns = _columns(rows)
    values = {column: [row[column] for row in rows if column in row] for column in columns}
    stds = {column: _sample_std(values[column]) for column in columns}
    if all(std is None for std in stds.values()):
        stds = {column: 0.0 if len(values[column]) == len(rows) else None for column in columns}
    described: dict[str, float | int | None] = {}
    for stat in _BASIC_STATS:
        for column in columns:
            data = values[column]
            if stat == "mean":
                described[f"mean/{column}"] = _mean(data)
            elif stat == "max":
                described[f"max/{column}"] = max(data)
            elif stat == "min":
                described[f"min/{column}"] = min(data)
            elif stat == "median":
                described[f"median/{column}"] = _median(data)
            elif stds[column] is not None:
                described[f"std/{column}"] = stds[column]
    return _reported(described)


def _quantile(values: Sequence[float | int], q: float) -> float:
    """Linear interpolation between the closest ranks (the common default)."""
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    fraction = position - low
    value = float(ordered[low] + (ordered[high] - ordered[low]) * fraction)
    if math.isfinite(value):
        return value
    return float(ordered[low] * (1 - fraction) + ordered[high] * fraction)  # the difference overflowed


def _beta_fraction(a: float, b: float, x: float) -> float:
    """The continued fraction of the regularized incomplete beta function (modified Lentz)."""
    tiny, front = 1e-300, 1.0
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    result = d
    for m in range(1, 400):
        for numerator in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                          -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            front = c * d
            result *= front
        if abs(front - 1.0) < 1e-15:
            break
    return result


def _regularized_beta(a: float, b: float, x: float) -> float:
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(log_front) * _beta_fraction(a, b, x) / a
    return 1.0 - math.exp(log_front) * _beta_fraction(b, a, 1.0 - x) / b


def _student_t_cdf(t: float, df: float) -> float:
    tail = 0.5 * _regularized_beta(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t >= 0 else tail


def student_t_quantile(p: float, df: float) -> float:
    """The ``p`` quantile (0.5 < p < 1) of Student's t with ``df`` degrees of freedom, by bisection."""
    low, high = 0.0, 1.0
    while _student_t_cdf(high, df) < p:
        high *= 2.0
    for _ in range(200):
        middle = (low + high) / 2.0
        if _student_t_cdf(middle, df) < p:
            low = middle
        else:
            high = middle
        if high - low < 1e-13 * max(1.0, high):
            break
    return (low + high) / 2.0


def _interval(mean: float, spread: float, n: int) -> tuple[float, float] | None:
    """The 95% Student-t interval of a mean with standard error ``spread`` (none for one value)."""
    if n <= 1:
        return None
    if spread == 0:
        return mean, mean
    half = student_t_quantile(0.975, n - 1) * spread
    return mean - half, mean + half


def _repeat_level(rows: Sequence[tuple[int, int, Numbers]]) -> list[dict[str, Any]]:
    """Per rollout index, the statistics of each field across tasks (only with several repeats)."""
    repeats = sorted({rollout for _, rollout, _ in rows})
    if len(repeats) < 2:
        return []
    total_tasks = len({task for task, _, _ in rows})
    columns = _columns(numbers for _, _, numbers in rows)
    entries = []
    for repeat in repeats:
        group = [(task, numbers) for task, rollout, numbers in rows if rollout == repeat]
        present = len({task for task, _ in group})
        entry: dict[str, Any] = {ROLLOUT_INDEX: repeat, "sample_count": present,
                                 "missing_count": total_tasks - present}
        for column in columns:
            data = [numbers[column] for _, numbers in group if column in numbers]
            if data:
                entry.update(_spread_stats(column, data))
        entries.append(entry)
    return entries


def _spread_stats(column: str, data: Sequence[float | int]) -> Stats:
    n = len(data)
    mean = _mean(data)
    std = _stdev(data) if n > 1 else 0.0
    sem = std / math.sqrt(n)
    stats = {f"mean/{column}": mean, f"median/{column}": float(_median(data)), f"std/{column}": std,
             f"sem/{column}": sem, f"min/{column}": float(min(data)), f"max/{column}": float(max(data)),
             f"p25/{column}": _quantile(data, 0.25), f"p75/{column}": _quantile(data, 0.75)}
    interval = _interval(mean, sem, n)
    if interval is not None:
        stats[f"ci_low_95/{column}"], stats[f"ci_high_95/{column}"] = interval
    return _reported(stats)


def _repeat_aggregated(name: str) -> bool:
    return (name not in _NOT_METRICS and not name.startswith(_NOT_REPEAT_AGGREGATED)
            and not name.endswith(_NOT_REPEAT_AGGREGATED_SUFFIXES) and "_across_repeats/" not in name)


def _across_repeats(repeat_level: Sequence[Mapping[str, Any]]) -> Stats:
    """Each per-repeat estimate (``mean/<f>``) summarized across the repeats."""
    columns = _columns({key: 0 for key, value in entry.items()
                        if _repeat_aggregated(key) and _number(value) is not None} for entry in repeat_level)
    found: dict[str, float] = {}
    for column in columns:
        data = [entry[column] for entry in repeat_level if _number(entry.get(column)) is not None]
        n = len(data)
        mean = _mean(data)
        std = _stdev(data) if n > 1 else 0.0
        spread = std / math.sqrt(n)
        found.update({f"mean_across_repeats/{column}": mean,
                      f"median_across_repeats/{column}": float(_median(data)),
                      f"std_across_repeats/{column}": std, f"min_across_repeats/{column}": float(min(data)),
                      f"max_across_repeats/{column}": float(max(data)), f"se_across_repeats/{column}": spread})
        interval = _interval(mean, spread, n)
        if interval is not None:
            found[f"ci_low_95_across_repeats/{column}"], found[f"ci_high_95_across_repeats/{column}"] = interval
    return _reported(found)


def _coverage(every: Sequence[Mapping[str, Any]], scored: Sequence[Mapping[str, Any]]) -> dict[str, int]:
    masked = len(every) - len(scored)
    if not masked:
        return {}
    measured_tasks = {_index(row, TASK_INDEX) for row in scored}
    all_tasks = {_index(row, TASK_INDEX) for row in every}
    return {"coverage/measured_rollouts": len(scored), "coverage/masked_rollouts": masked,
            "coverage/measured_tasks": len(measured_tasks),
            "coverage/fully_masked_tasks": len(all_tasks - measured_tasks)}


def _group_level(scored: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    by_task: dict[int, list[Mapping[str, Any]]] = {}
    for row in scored:
        by_task.setdefault(_index(row, TASK_INDEX), []).append(row)
    groups = []
    for task in sorted(by_task):
        rows = by_task[task]
        count = len(rows)
        infos = sorted((_rollout_info(row) for row in rows), key=lambda info: info[ROLLOUT_INDEX])
        groups.append({TASK_INDEX: task, **_describe([numeric_fields(row) for row in rows]),
                       "sample": {"agent_ref": {"name": "agent"}}, "num_rollouts": count,
                       "expected_num_rollouts": count, "missing_num_rollouts": 0,
                       "reward_profile_completion_pct": 100.0, "rollout_infos": infos})
    return groups


def aggregate_metrics(verify_responses: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """NeMo Gym's ``AggregateMetrics`` of finished rollout rows (see the module docstring)."""
    empty: dict[str, Any] = {"group_level_metrics": [], "agent_metrics": {}, "key_metrics": {},
                             "perf_summary": None, "repeat_level_metrics": []}
    if not verify_responses:
        return empty
    scored = [row for row in verify_responses if not row.get(MASK_SAMPLE)]
    coverage = _coverage(verify_responses, scored)
    if not scored:
        return {**empty, "agent_metrics": dict(coverage), "key_metrics": dict(coverage)}
    indexed = [(_index(row, TASK_INDEX), _index(row, ROLLOUT_INDEX), numeric_fields(row)) for row in scored]
    repeat_level = _repeat_level(indexed)
    agent = {**_describe([numbers for _, _, numbers in indexed]), **_across_repeats(repeat_level), **coverage,
             "num_repeats": len({_index(row, ROLLOUT_INDEX) for row in verify_responses})}
    key = {**{name: value for name, value in agent.items() if name.startswith("mean/")}, **coverage}
    return {"group_level_metrics": _group_level(scored), "agent_metrics": agent, "key_metrics": key,
            "perf_summary": None, "repeat_level_metrics": repeat_level}


class AggregateMetricsRequest(BaseModel):
    """NeMo Gym's ``AggregateMetricsRequest``: the finished rows to aggregate."""

    model_config = ConfigDict(extra="forbid")

    verify_responses: list[dict[str, Any]] = Field(max_length=MAX_VERIFY_RESPONSES)


def mount_aggregate_metrics(app: FastAPI) -> None:
    """Serve ``POST /aggregate_metrics`` on ``app``."""

    async def route(body: AggregateMetricsRequest) -> dict[str, Any]:
        return aggregate_metrics(body.verify_responses)

    app.add_api_route("/aggregate_metrics", route, methods=["POST"])
