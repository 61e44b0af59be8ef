"""``nemo-gym-ckpt demo`` end to end: the real command, the quickstart mesh, SIGKILL, restore."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from nemo_gym_ckpt.collect.published import find_latest
from nemo_gym_ckpt.demo.run import CUT_TRIES

pytestmark = pytest.mark.e2e

REQUIRED = ("rollouts", "identical_to_reference", "restored_episodes", "continued_model_calls_skipped",
            "generation_cuts", "cut_calls", "cut_tokens_staged", "tokens_kept", "tokens_regenerated",
            "uncut_calls", "tokens_regenerated_uncut", "checkpoint_pause_ms", "restore_ms", "checkpoint_bytes")


@pytest.mark.timeout(400)
def test_the_demo_restores_a_killed_mesh_to_the_rows_of_the_reference(tmp_path: Path) -> None:
    report, work = tmp_path / "demo.json", tmp_path / "work"
    done = subprocess.run(
        [sys.executable, "-m", "nemo_gym_ckpt", "demo", "--json", str(report), "--rollouts", "24",
         "--workdir", str(work)],
        cwd=tmp_path, env={**os.environ, "PYTHONUNBUFFERED": "1"}, capture_output=True, timeout=360)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    metrics = orjson.loads(report.read_bytes())
    assert set(REQUIRED) <= set(metrics)
    assert metrics["rollouts"] == 24 and metrics["identical_to_reference"] is True
    assert metrics["restored_episodes"] >= 1 and metrics["rollouts_in_flight"] >= metrics["restored_episodes"]
    assert len(metrics["servers_killed"]) == 5 and metrics["rows_before_crash"] < 24
    assert metrics["checkpoint_bytes"] > 0 and metrics["checkpoint_pause_ms"] > 0
    assert metrics["restore_ms"] > 0
    assert metrics["token_arrays_compared"] > 0 and metrics["max_logprob_diff"] <= 1e-4
    # a skipped call comes back in its row without token arrays unless they were restored with it
    assert 0 <= metrics["token_arrays_not_restored"] <= metrics["continued_model_calls_skipped"]
    # generation cuts (on by default): the checkpoint caught calls mid-generation; after the crash every
    # token they had produced was served from staging, none generated again, and the rows are the
    # reference's token for token (identical_to_reference above compares the token arrays)
    assert metrics["generation_cuts"] is True and metrics["cut_calls"] >= 1
    assert 0 <= metrics["uncut_checkpoints_before"] < CUT_TRIES  # a loaded machine may need another try
    assert metrics["staging_keys"] == metrics["cut_calls"]  # every cut the commit kept was continued
    assert metrics["tokens_kept"] > 0 and metrics["tokens_kept"] == metrics["cut_tokens_staged"]
    assert metrics["tokens_regenerated"] == 0
    assert metrics["cut_calls"] + metrics["uncut_calls"] == metrics["calls_in_flight_at_checkpoint"]
    assert metrics["tokens_regenerated_uncut"] >= 0 and metrics["tokens_after_cut"] >= 0
    latest = find_latest(work / "checkpoints" / "collection")
    assert latest is not None and latest.checkpoint_id == metrics["checkpoint_id"]
    in_flight = len(latest.continued) + len(latest.restarted)
    assert in_flight == metrics["rollouts_in_flight"]
    assert metrics["restored_episodes"] + metrics["restarted_episodes"] <= in_flight
    table = done.stdout.decode()
    assert "checkpoint + SIGKILL + restore" in table and "rows identical" in table and "yes" in table
    assert f"{metrics['tokens_kept']} served from staging, 0 generated again" in table
