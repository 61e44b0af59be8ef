"""NeMo Gym's own string_match server, run in our mesh, grades the rows our collector gathers.

Not our string_match: NeMo Gym 0.7.0's ``resources_servers/string_match/app.py``, started by our
launcher in NeMo Gym's Python (``ng_python``) inside our participant shell, from this repository's
``resources_servers/nemo_gym/string_match`` config (``package: nemo_gym``). ``nemo-gym-ckpt collect``
launches the mesh (our policy model in front of an inference worker with the script engine, which
answers each row's prompt with the text of ``tests/support/verifier_cases.CASES``; simple_agent;
single_agent_turn) and writes one row per task: each must carry the reward NeMo Gym's server gives
that answer, with the answer it extracted, and at least one row is rewarded.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from nemo_gym_ckpt.collect.rows import read_jsonl
from nemo_gym_ckpt.config import NEMO_GYM_PYTHON_ENV, PROJECT_ROOT
from tests.support.verifier_cases import CASES, verifier_mesh

pytestmark = [pytest.mark.interop, pytest.mark.timeout(600)]

INSTANCE = "string_match"
COLLECT_TIMEOUT_S = 540


def test_nemo_gyms_string_match_in_our_mesh_gives_rewarded_rows(ng_python: Path, tmp_path: Path) -> None:
    raw = verifier_mesh([INSTANCE], tmp_path / "checkpoints", "unused", checkpoint=False)
    raw["head_server"] = {"port": 0}
    config = tmp_path / "mesh.yaml"
    config.write_text(yaml.safe_dump(raw))
    output = tmp_path / "rows.jsonl"
    done = subprocess.run(
        [sys.executable, "-m", "nemo_gym_ckpt", "collect", "--config", str(config), "--output", str(output),
         "--environment", f"env_{INSTANCE}", "--ready-timeout-s", "400"],
        cwd=PROJECT_ROOT, env={**os.environ, NEMO_GYM_PYTHON_ENV: str(ng_python)}, capture_output=True,
        text=True, timeout=COLLECT_TIMEOUT_S, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    # the verifier that graded was NeMo Gym's (its bridge child names the class it serves), not ours
    server_log = output.with_name(f"{output.stem}_servers.log").read_text()
    assert f"{INSTANCE}: NeMo Gym's resources_servers.string_match.app." in server_log, server_log[-4000:]
    rows = list(read_jsonl(output))
    expected = {case.row: case for case in CASES if case.instance == INSTANCE}
    assert len(rows) == len(expected), rows
    for row in rows:
        case = expected[row["_ng_task_index"]]
        assert row["reward"] == case.reward, (row["_ng_task_index"], row["reward"], case)
        assert "extracted_answer" in row, sorted(row)  # a field only NeMo Gym's string_match writes
    assert any(row["reward"] == 1.0 for row in rows)
