"""Interop (a): NeMo Gym 0.7's own rollout collection against a mesh our launcher runs, checkpointing on.

Our mesh is ``configs/quickstart.yaml`` (the embedded CPU model, greedy) launched by our launcher with
the ``checkpoint:`` block on, its head server on a free port. NeMo Gym's collector runs as a real
subprocess of the Python 3.13 venv that has ``nemo-gym==0.7.0``: ``gym eval run --no-serve`` (what
``ng_collect_rollouts`` runs) with its head address as NeMo Gym takes it (``+head_server.host/port``),
on a few rows that name their agent the way NeMo Gym's datasets do (``agent_ref``). It reads our
head's ``/global_config_dict_yaml``, finds ``simple_agent`` fronted by our ``single_agent_turn``
environment server, POSTs each row to its ``/run`` (no rollout prefix: the rollout is named by the
row's ``_ng_task_index``/``_ng_rollout_index``, which our server admits under checkpointing), then
``/aggregate_metrics``. It must exit 0 with every row written, rewarded, with token ids.

Then our checks on what it wrote: our collector (``nemo-gym-ckpt collect --head``) runs the same rows
on the same mesh; NeMo Gym's rows must be the rows ours writes (``compare_rows``: every field, the
token arrays of every model call on both sides), its materialized inputs and aggregate metrics the
ones ours writes, and our resume must count its rows as done.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from nemo_gym_ckpt.collect.dispatch import done_keys
from nemo_gym_ckpt.collect.rows import compare_rows, materialized_path, metrics_path, read_jsonl
from nemo_gym_ckpt.config import PROJECT_ROOT, load_config
from nemo_gym_ckpt.launch.launcher import MeshLauncher

pytestmark = [pytest.mark.interop, pytest.mark.timeout(300)]

ROWS = 3
TOKEN = "interop-a-token"
AGENT_REF = {"type": "responses_api_agents", "name": "simple_agent"}
ENVIRONMENT = "single_agent_turn"
TIMINGS = ("perf_summary",)  # wall-clock figures: equal only by chance


def _input_rows(path: Path) -> None:
    source = PROJECT_ROOT / "resources_servers/calculator_tools/data/quickstart.jsonl"
    rows = [json.loads(line) for line in source.read_text().splitlines()[:ROWS]]
    path.write_text("".join(json.dumps({**row, "agent_ref": AGENT_REF}) + "\n" for row in rows))


def _nemo_gyms_collector(ng_python: Path, cwd: Path, head: str) -> subprocess.CompletedProcess[str]:
    host, port = head.removeprefix("http://").rsplit(":", 1)
    env = {key: value for key, value in os.environ.items() if not key.startswith("NEMO_GYM_CONFIG")}
    return subprocess.run(
        [str(ng_python.parent / "gym"), "eval", "run", "--no-serve", "--input", "in.jsonl",
         "--output", "theirs/rollouts.jsonl", "--no-health-check",
         f"+head_server.host={host}", f"+head_server.port={port}"],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=150, check=False,
    )


def _our_collector(cwd: Path, head: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "nemo_gym_ckpt", "collect", "--head", head, "--input", "in.jsonl",
         "--output", "ours/rollouts.jsonl"],
        cwd=cwd, capture_output=True, text=True, timeout=150, check=False,
    )


def _metrics(output: Path) -> list[dict[str, Any]]:
    entries = json.loads(metrics_path(output).read_text())
    return [{key: value for key, value in entry.items() if key not in TIMINGS} for entry in entries]


def test_nemo_gyms_collector_gets_our_rows_from_our_mesh(ng_python: Path, tmp_path: Path) -> None:
    _input_rows(tmp_path / "in.jsonl")
    overrides = ["head_server.port=0", "checkpoint.enabled=true", f"checkpoint.root={tmp_path / 'ckpt'}",
                 f"checkpoint.control_auth_token={TOKEN}"]
    with MeshLauncher(load_config([PROJECT_ROOT / "configs/quickstart.yaml"], overrides)) as launcher:
        launcher.start(ready_timeout_s=120)
        theirs_done = _nemo_gyms_collector(ng_python, tmp_path, launcher.head_url)
        ours_done = _our_collector(tmp_path, launcher.head_url)
        assert launcher.exited() is None  # our servers lived through both
    assert theirs_done.returncode == 0, (theirs_done.stdout[-3000:], theirs_done.stderr[-3000:])
    assert ours_done.returncode == 0, ours_done.stderr[-3000:]
    theirs, ours = tmp_path / "theirs/rollouts.jsonl", tmp_path / "ours/rollouts.jsonl"
    collected = list(read_jsonl(theirs))
    assert sorted(row["_ng_task_index"] for row in collected) == list(range(ROWS))
    assert all(row["agent_ref"] == AGENT_REF for row in collected)
    assert all((row["_ng_environment_server"], row["_ng_result_type"]) == (ENVIRONMENT, ENVIRONMENT)
               for row in collected)
    assert all(isinstance(row["reward"], float) and row["response"]["output"] for row in collected)
    assert not (tmp_path / "theirs/rollouts_failures.jsonl").read_text().strip()

    comparison = compare_rows(read_jsonl(ours), collected)
    assert comparison.compared == ROWS and comparison.identical, comparison
    assert comparison.token_arrays_compared >= ROWS and comparison.token_arrays_absent == 0
    assert done_keys(theirs) == {(task, 0) for task in range(ROWS)}  # our resume counts them as done
    assert list(read_jsonl(materialized_path(theirs))) == list(read_jsonl(materialized_path(ours)))
    assert _metrics(theirs) == _metrics(ours)
    assert "mean/reward" in _metrics(theirs)[0]["key_metrics"]
