"""Smoke tests of the checkpoint bench suites on the quickstart mesh: their shape, never their numbers.

``nemo-gym-ckpt bench --quick --only prepare_latency checkpoint_overhead`` in small form: the
suites must keep running against the real mesh and report what ``docs/benchmarks.md`` reads.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from nemo_gym_ckpt.bench.checkpoints import QUICK_LEVELS
from nemo_gym_ckpt.cli import bench

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def test_the_quick_checkpoint_suites_report_their_shape(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    bench.configure(parser)
    args = parser.parse_args(["--quick", "--only", "prepare_latency", "checkpoint_overhead", "--out", str(tmp_path)])
    assert bench.main(args) == 0
    results = json.loads((tmp_path / "results.json").read_text())

    prepare = results["prepare_latency"]
    assert [level["in_flight"] for level in prepare["levels"]] == list(QUICK_LEVELS)
    for level in prepare["levels"]:
        assert level["failed"] == 0, level.get("first_failure")
        assert level["checkpoints"] == prepare["checkpoints_per_level"] >= 2
        for op in ("prepare", "commit", "resume"):
            assert 0 < level[op]["p50_ms"] <= level[op]["p99_ms"] <= level[op]["max_ms"]
        assert set(level["prepare_stage_p50_ms"]) == {"environment", "model", "agent", "resources"}
        assert set(level["status_before_prepare_p50"]) == {"environment", "model", "agent", "resources"}
        assert set(level["status_call_p50_ms"]) == {"environment", "model", "agent", "resources"}
    busy = prepare["levels"][-1]
    assert busy["rollouts_finished"] >= 0 and busy["rollouts_per_s"] >= 0  # a short window: maybe none ended
    assert busy["status_before_prepare_p50"]["environment"]["episodes"] > 0, "rollouts were in flight"
    assert busy["records_committed_p50"]["single_agent_turn"] > 0

    overhead = results["checkpoint_overhead"]
    assert overhead["failed"] == 0
    ratios = ("on_over_off", "off_b_over_off_a", "cpu_per_rollout_on_over_off", "cpu_per_rollout_off_b_over_off_a",
              "participants_cpu_per_rollout_on_over_off", "participants_cpu_per_rollout_off_b_over_off_a")
    for ratio in ratios:
        stats = overhead[ratio]
        assert len(stats["values"]) == overhead["rounds"]
        assert 0 < stats["min"] <= stats["median"] <= stats["max"]
    assert set(overhead["cpu_ms_per_rollout_p50"]) == {"off_a", "on", "off_b"}
    assert overhead["cpu_ms_per_rollout_p50"]["on"]["inference_worker"] > 0
