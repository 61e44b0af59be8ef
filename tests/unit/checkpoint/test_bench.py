"""The checkpoint benchmarks run end to end at small sizes and report what they promise."""

from __future__ import annotations

from pathlib import Path

import pytest

from nemo_gym_ckpt.bench import protocol as bench

pytestmark = pytest.mark.unit


def test_commit_throughput_is_a_ratio_to_the_fsync_floor(tmp_path: Path) -> None:
    result = bench.commit_throughput(records=300, record_bytes=4096, repeats=1, root=tmp_path)
    assert result["records"] == 300 and result["fsync_write_mb_s"] > 0 and result["commit_mb_s"] > 0
    commit, floor, half = result["commit_mb_s"], result["fsync_write_mb_s"], 0.05  # each rounded to 0.1
    lowest, highest = (commit - half) / (floor + half), (commit + half) / max(floor - half, 1e-9)
    assert lowest - 0.0005 <= result["ratio_to_fsync_write"] <= highest + 0.0005  # the ratio of the two
    records = next(tmp_path.rglob("records-*.jsonl"))
    assert abs(records.stat().st_size - 300 * 4096) < 300  # records of 4 KB, as asked


def test_admission_overhead_is_measured_against_an_empty_call() -> None:
    result = bench.admission_overhead(calls=2_000)
    assert result["admit_ns"] > 0 and result["overhead_ns"] == result["admit_ns"] - result["empty_call_ns"]
