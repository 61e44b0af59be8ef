"""``nemo-gym-ckpt collect`` end to end: a real multi-process mesh launched from YAML.

inference worker (the embedded default model on the CPU) + policy model + calculator_tools +
simple_agent + single_agent_turn, each its own process. The first run is stopped with Ctrl-C after a
few rows; it must exit 130, keep whole rows only and leave no server process behind. The second run
finishes the rest without redoing a row, and the rows show multi-turn tool use with token ids.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import orjson
import pytest

from nemo_gym_ckpt.collect.rows import failures_path, metrics_path, read_jsonl

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
LIMIT = 16
MESH_YAML = """
head_server: {port: 0}
inference_worker:
  responses_api_models:
    inference_worker:
      entrypoint: app.py
      engine: transformers
policy_model:
  responses_api_models:
    policy_model:
      entrypoint: app.py
      worker: {type: responses_api_models, name: inference_worker}
      return_token_ids: true
      temperature: 0.0
      max_tokens: 64
calculator_tools:
  resources_servers:
    calculator_tools:
      entrypoint: app.py
      domain: math
simple_agent:
  responses_api_agents:
    simple_agent:
      entrypoint: app.py
      model_server: {type: responses_api_models, name: policy_model}
      resources_server: {type: resources_servers, name: calculator_tools}
      max_steps: 4
      return_token_ids: true
single_agent_turn:
  environment_servers:
    single_agent_turn:
      entrypoint: app.py
      agent_server: {type: responses_api_agents, name: simple_agent}
      resources_server: {type: resources_servers, name: calculator_tools}
      datasets:
        - name: quickstart
          type: example
          jsonl_fpath: resources_servers/calculator_tools/data/quickstart.jsonl
"""


def collect_command(config: Path, output: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "nemo_gym_ckpt", "collect", "--config", str(config),
            "--output", str(output), "--limit", str(LIMIT), "--ready-timeout-s", "90", *extra]


def server_processes(parent: int) -> list[int]:
    """Live ``nemo_gym_ckpt.cli.serve`` processes started by ``parent`` (from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if b"nemo_gym_ckpt.cli.serve" in cmdline and f"NEMO_GYM_CKPT_PARENT_PID={parent}".encode() in environ:
            found.append(int(entry.name))
    return found


def wait_for_rows(proc: subprocess.Popen[bytes], output: Path, count: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while len(list(read_jsonl(output, complete_lines_only=True))) < count:
        assert proc.poll() is None, f"collect exited early with {proc.returncode}"
        assert time.monotonic() < deadline, f"no {count} rows within {timeout_s} s"
        time.sleep(0.05)


@pytest.mark.timeout(420)  # two mesh launches and their collections: minutes on a loaded 2-core machine
def test_collect_is_stopped_by_ctrl_c_and_a_second_run_finishes(tmp_path: Path) -> None:
    config = tmp_path / "mesh.yaml"
    config.write_text(MESH_YAML)
    output = tmp_path / "rollouts.jsonl"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    first = subprocess.Popen(collect_command(config, output, "--concurrency", "1"), cwd=tmp_path, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        wait_for_rows(first, output, 2, timeout_s=120)
        first.send_signal(signal.SIGINT)
        _, err = first.communicate(timeout=30)
    finally:
        if first.poll() is None:
            first.kill()
    text = err.decode()
    assert first.returncode == 130, text
    assert "stopped by SIGINT" in text
    head = re.search(r"head server (http://\S+);", text)
    assert head is not None, text
    with pytest.raises(httpx.TransportError):
        httpx.get(head[1] + "/servers", timeout=2.0)
    assert server_processes(first.pid) == []
    kept = list(read_jsonl(output))  # every line whole
    assert 2 <= len(kept) < LIMIT

    second = subprocess.run(collect_command(config, output, "--concurrency", "8"), cwd=tmp_path, env=env,
                            capture_output=True, timeout=150)
    assert second.returncode == 0, second.stderr.decode()[-3000:]
    assert f"already in {output}" in second.stdout.decode()
    rows = list(read_jsonl(output))
    keys = sorted((row["_ng_task_index"], row["_ng_rollout_index"]) for row in rows)
    assert keys == [(task, 0) for task in range(LIMIT)]  # nothing redone, nothing missing
    assert all(row["_ng_attempt_index"] == 0 for row in rows)
    assert not failures_path(output).exists() or not failures_path(output).read_bytes()
    for row in rows:
        kinds = [item["type"] for item in row["response"]["output"]]
        assert kinds[:2] == ["function_call", "function_call_output"] and kinds[-1] == "message", kinds
        assert row["response"]["output"][0]["generation_token_ids"]  # token ids rode along
    (entry,) = orjson.loads(metrics_path(output).read_bytes())  # NeMo Gym's layout, over every row
    reward = entry["agent_metrics"]["mean/reward"]
    assert sum(group["num_rollouts"] for group in entry["group_level_metrics"]) == LIMIT and reward >= 0.75, entry
    assert f"mean reward {reward:.4f} over {LIMIT} rollouts" in second.stdout.decode()
