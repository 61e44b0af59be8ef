"""The rollouts bench's pure parts: the measurement window, replayed bodies, CPU accounting."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

import pytest

from nemo_gym_ckpt.bench.mesh import checkpoint_root
from nemo_gym_ckpt.bench.rollouts import CpuMeter, replay_of, window_loop
from nemo_gym_ckpt.errors import Unavailable

pytestmark = pytest.mark.unit


async def test_the_window_counts_calls_that_end_inside_it_and_failures_apart() -> None:
    calls = []

    async def call(key: str) -> None:
        calls.append(key)
        await asyncio.sleep(0.01)
        if len(calls) % 5 == 0:
            raise Unavailable("peer gone")

    began = time.perf_counter()
    point = await window_loop(call, 4, 0.3, ramp_s=0.05)
    elapsed = time.perf_counter() - began
    assert point["concurrency"] == 4 and point["failed"] >= 1
    assert point["first_failure"] == "unavailable: peer gone"
    assert 0 < point["rollouts"] < len(calls)
    # per second of the window: it lasts its 0.3 s at least (longer when the loop is held), and no
    # longer than the whole run (the rate is rounded to 0.01)
    assert point["rollouts"] / elapsed - 0.01 <= point["rollouts_per_s"] <= point["rollouts"] / 0.3 + 0.01
    assert 10 <= point["p50_ms"] <= point["p99_ms"]
    assert len(set(calls)) == len(calls), "every call gets its own key"


def test_a_rollout_row_replays_as_the_calls_it_made() -> None:
    params = {"input": "What is 2 + 3?", "tools": [{"name": "add"}]}
    task: dict[str, Any] = {"responses_create_params": params, "expected_answer": 5}
    call_items = [
        {"type": "function_call", "name": "add", "arguments": '{"a":2,"b":3}', "call_id": "c1",
         "prompt_token_ids": [1, 2], "generation_token_ids": [7, 8, 9]},
        {"type": "function_call_output", "call_id": "c1", "output": "5"},
        {"type": "message", "prompt_token_ids": [1, 2, 7, 8, 9, 4], "generation_token_ids": [5, 6]},
    ]
    replay = replay_of(task, {"response": {"output": call_items}, "reward": 1.0}, "tiny")
    assert [body["prompt"] for body in replay.worker_bodies] == [[1, 2], [1, 2, 7, 8, 9, 4]]
    assert [body["max_tokens"] for body in replay.worker_bodies] == [3, 2]
    assert replay.generations == [[7, 8, 9], [5, 6]]
    user = {"role": "user", "content": "What is 2 + 3?"}
    assert [body["input"] for body in replay.policy_bodies] == [[user], [user, *call_items[:2]]]
    assert all(body["tools"] == params["tools"] and body["return_token_ids"] for body in replay.policy_bodies)
    assert replay.tool_calls == [("add", {"a": 2, "b": 3})]


def test_the_cpu_meter_charges_each_process() -> None:
    meter = CpuMeter({"me": os.getpid()})
    meter.start()
    sum(i * i for i in range(300_000))
    usage = meter.stop()
    if not os.path.exists("/proc/self/stat"):
        pytest.skip("no /proc: only the driver is measured")
    assert usage["cpu_s"]["me"] >= 0 and usage["cpu_s"]["driver"] > 0
    assert usage["mesh_busy_cores"] > 0 and "machine_busy_cores" in usage


def test_a_bench_root_goes_with_the_staging_the_worker_made_beside_it() -> None:
    with checkpoint_root("ngc-test-root-") as root:
        staging = Path(f"{root}.generation-cuts") / "inference_worker"
        staging.mkdir(parents=True)
        (staging / "cut-0.jsonl").write_text("{}\n")
        assert root.is_dir()
    assert not root.exists() and not staging.parent.exists()
