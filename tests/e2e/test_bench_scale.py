"""Smoke test of the ``scale`` bench suite on the quickstart mesh: its shape, never its numbers.

``nemo-gym-ckpt bench --quick --only scale``: a handful of rollouts in flight, one full and one
incremental checkpoint, SIGKILL, a restore from the incremental one and the crash test.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from nemo_gym_ckpt.bench.scale import QUICK_LEVELS
from nemo_gym_ckpt.cli import bench

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(420)]


def test_the_quick_scale_suite_reports_its_shape(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    bench.configure(parser)
    assert bench.main(parser.parse_args(["--quick", "--only", "scale", "--out", str(tmp_path)])) == 0
    result = json.loads((tmp_path / "results.json").read_text())["scale"]
    [level] = result["levels"]
    assert level["in_flight"] == QUICK_LEVELS[0] and level["failed"] == 0, level.get("first_failure")
    for kind in ("full", "incremental"):
        assert level[f"{kind}_pause"]["p50_ms"] > 0 and level[f"{kind}_bytes_written_p50"] > 0
    assert level["records"]["single_agent_turn"] > 0 and level["fsync_floor_mb_s"] > 0
    assert level["participant_write_over_floor"] > 0  # each participant's own write, from its status
    assert level["fsync_floor_loaded_mb_s"] > 0 and level["participant_write_over_loaded_floor"] > 0
    assert level["writes_at_once_mb_s"] > 0 and level["participant_write_over_writes_at_once"] > 0
    assert set(level["participant_write_ms_p50_full"]) == set(level["records"])
    longest = [checkpoint["longest_write"] for checkpoint in level["checkpoints"]]  # what each speed is read over
    assert all(write["participant"] in level["records"] and write["write_ms"] > 0 for write in longest)
    assert all(0 <= write["sync_ms"] <= write["write_ms"] for write in longest)  # its fsyncs, inside it
    assert level["restore_incremental_ms"] > 0 and set(level["peak_memory_mb"]) >= {"policy_model", "simple_agent"}
    hold = level["generation_hold"]  # the bench holds the worker from ready to resume
    assert hold["holds"] >= 2 and hold["releases"] == hold["holds"] and hold["expired"] == 0
    assert hold["held_by"] is None and hold["held_ms"] > 0
    crash = level["crash"]
    assert crash["finished_twice"] == 0 and crash["never_finished"] == 0 and crash["failed_after_restore"] == 0
    assert crash["started_rollouts"] == crash["finished_before_crash"] + crash["dispatched_after_restore"]
