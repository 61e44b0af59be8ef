"""``aggregate_metrics`` and ``POST /aggregate_metrics`` on values near the float limit: a reply, never a 500."""

from __future__ import annotations

import json
import sys
from typing import Any

import httpx
import pytest

from nemo_gym_ckpt.aggregate_metrics import aggregate_metrics, mount_aggregate_metrics
from nemo_gym_ckpt.server import create_app

pytestmark = pytest.mark.unit

BIG = 1e308
HUGE = 1.7e308  # its doubled difference is past the float range


def rows(rewards: list[Any]) -> list[dict[str, Any]]:
    """One row per (task, rollout): rewards[task][rollout]."""
    return [{"_ng_task_index": task, "_ng_rollout_index": rollout, "reward": reward}
            for task, repeats in enumerate(rewards) for rollout, reward in enumerate(repeats)]


def strict_json(metrics: dict[str, Any]) -> Any:
    """``metrics`` through JSON that refuses ``inf`` and ``nan``."""
    return json.loads(json.dumps(metrics, allow_nan=False))


def test_the_mean_and_median_of_large_finite_values_stay_finite() -> None:
    metrics = strict_json(aggregate_metrics(rows([[BIG, BIG], [BIG, BIG]])))
    group = metrics["group_level_metrics"][0]
    assert (group["mean/reward"], group["median/reward"], group["std/reward"]) == (BIG, BIG, 0.0)
    assert metrics["key_metrics"] == {"mean/reward": BIG}
    for entry in metrics["repeat_level_metrics"]:
        assert (entry["mean/reward"], entry["median/reward"], entry["p25/reward"]) == (BIG, BIG, BIG)
    assert metrics["agent_metrics"]["mean_across_repeats/mean/reward"] == BIG


def test_the_mean_of_many_values_at_the_float_limit_is_the_limit() -> None:
    top = sys.float_info.max
    metrics = strict_json(aggregate_metrics(rows([[top, top, top], [top, top, 1.0]])))
    assert metrics["key_metrics"] == {"mean/reward": pytest.approx(top * (5 / 6))}
    means = [group["mean/reward"] for group in metrics["group_level_metrics"]]
    assert means == [top, pytest.approx(top * (2 / 3))]


def test_a_statistic_past_the_float_range_is_none() -> None:
    metrics = strict_json(aggregate_metrics(rows([[HUGE, -HUGE], [HUGE, -HUGE]])))
    group = metrics["group_level_metrics"][0]
    assert (group["mean/reward"], group["median/reward"], group["std/reward"]) == (0.0, 0.0, None)
    entry = metrics["repeat_level_metrics"][0]
    assert (entry["mean/reward"], entry["std/reward"], entry["p75/reward"]) == (HUGE, 0.0, HUGE)
    quantiles = aggregate_metrics(rows([[-HUGE], [HUGE], [-HUGE], [HUGE]]))["agent_metrics"]
    assert quantiles["std/reward"] is None and quantiles["median/reward"] == 0.0


def test_an_integer_past_the_float_range_is_not_a_metric() -> None:
    metrics = strict_json(aggregate_metrics(rows([[1, 10**400]])))
    assert metrics["agent_metrics"]["mean/reward"] == 1
    assert strict_json(aggregate_metrics(rows([[int(sys.float_info.max)] * 2])))["key_metrics"] == {
        "mean/reward": sys.float_info.max}


@pytest.mark.parametrize("rewards", [[[BIG, BIG]], [[HUGE, -HUGE, HUGE]], [[HUGE, HUGE], [-HUGE, -HUGE]]])
async def test_the_route_answers_200_near_the_float_limit(rewards: list[list[float]]) -> None:
    app = create_app("aggregate")
    mount_aggregate_metrics(app)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app, raise_app_exceptions=False),
                                 base_url="http://aggregate") as http:
        reply = await http.post("/aggregate_metrics", json={"verify_responses": rows(rewards)})
    assert reply.status_code == 200, reply.text
    assert reply.json() == strict_json(aggregate_metrics(rows(rewards)))
