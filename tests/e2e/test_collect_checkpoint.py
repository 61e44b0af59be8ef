"""``collect --checkpoint-dir`` end to end: the quickstart mesh as real processes, real signals.

One collection gets SIGUSR1 (a checkpoint, and it goes on), then SIGTERM (a checkpoint, then exit
75 with no server process left). The rerun with the same arguments restores the latest checkpoint
in fresh processes, continues the checkpointed rollouts as attempt 1 and finishes: every row once,
equal to an uninterrupted run's. A third run finds nothing left and starts nothing.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest

from nemo_gym_ckpt.collect.published import find_latest, is_checkpoint_id
from nemo_gym_ckpt.collect.rows import compare_rows, read_jsonl
from tests.e2e.test_collect import server_processes

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "configs" / "quickstart.yaml"
LIMIT = 40
ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}


def collect_command(output: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "nemo_gym_ckpt", "collect", "--config", str(QUICKSTART),
            "head_server.port=0", "--output", str(output), "--limit", str(LIMIT), "--concurrency", "8",
            "--ready-timeout-s", "120", *extra]


def rows_of(output: Path) -> list[dict[str, Any]]:
    return list(read_jsonl(output, complete_lines_only=True))


def wait_for(
    condition: Callable[[], bool], proc: subprocess.Popen[bytes], timeout_s: float, what: str
) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert proc.poll() is None, f"collect exited ({proc.returncode}) before: {what}"
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        time.sleep(0.02)


def snapshot(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in directory.rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """An uninterrupted run of the same rows, checkpointing off."""
    work = tmp_path_factory.mktemp("reference")
    command = collect_command(work / "rows.jsonl")
    done = subprocess.run(command, cwd=work, env=ENV, capture_output=True, timeout=240)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    return rows_of(work / "rows.jsonl")


@pytest.mark.timeout(480)
def test_sigusr1_checkpoints_sigterm_stops_with_75_and_a_rerun_finishes_like_an_uninterrupted_run(
    reference: list[dict[str, Any]], tmp_path: Path
) -> None:
    output, directory = tmp_path / "rows.jsonl", tmp_path / "ckpt"
    args = collect_command(output, "--checkpoint-dir", str(directory))
    first = subprocess.Popen(args, cwd=tmp_path, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        wait_for(lambda: len(rows_of(output)) >= 4, first, 150, "4 rows")
        first.send_signal(signal.SIGUSR1)
        wait_for(lambda: (directory / "LATEST").exists(), first, 60, "a checkpoint after SIGUSR1")
        after_usr1 = (directory / "LATEST").read_text().strip()
        written = len(rows_of(output))
        wait_for(lambda: len(rows_of(output)) > written, first, 60, "a row after the SIGUSR1 checkpoint")
        first.send_signal(signal.SIGTERM)
        _, err = first.communicate(timeout=60)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 75, err.decode()[-3000:]
    assert "checkpointed and stopped by SIGTERM" in err.decode()
    assert server_processes(first.pid) == []
    latest = find_latest(directory)
    assert latest is not None and latest.checkpoint_id != after_usr1
    assert sorted(p.name for p in directory.iterdir() if is_checkpoint_id(p.name)) == sorted(
        [after_usr1, latest.checkpoint_id])
    collection = orjson.loads((directory / latest.checkpoint_id / "collection.json").read_bytes())
    assert {"checkpoint_id", "run_id", "created_at", "continued", "restarted", "rows_done"} <= set(collection)
    assert latest.continued and latest.rows_done <= len(rows_of(output)) < LIMIT
    assert {"policy_model", "simple_agent", "single_agent_turn", "calculator_tools"} <= set(latest.manifests)
    restored_from = snapshot(directory / latest.checkpoint_id)

    second = subprocess.run(args, cwd=tmp_path, env=ENV, capture_output=True, timeout=240)
    assert second.returncode == 0, second.stderr.decode()[-3000:]
    assert "continued from a checkpoint" in second.stdout.decode()
    rows = rows_of(output)
    keys = [(row["_ng_task_index"], row["_ng_rollout_index"]) for row in rows]
    assert sorted(keys) == [(task, 0) for task in range(LIMIT)]  # every rollout once
    comparison = compare_rows(reference, rows)
    assert comparison.identical, comparison
    continued = {key.removesuffix("-0") for key in latest.continued}
    attempts = {str(row["_ng_task_index"]): row["_ng_attempt_index"] for row in rows}
    assert any(attempts[task] == 1 for task in continued)
    assert snapshot(directory / latest.checkpoint_id) == restored_from  # the restored-from directory

    log = tmp_path / "rows_servers.log"
    size = log.stat().st_size
    third = subprocess.run(args, cwd=tmp_path, env=ENV, capture_output=True, timeout=60)
    assert third.returncode == 0 and f"nothing left: all {LIMIT} rollouts" in third.stdout.decode()
    assert log.stat().st_size == size  # no server was started
