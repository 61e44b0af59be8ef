"""``scripts/example_controller.py`` (httpx and docs/protocol.md only) against the real participant apps.

It checkpoints three rollouts that wait on held model calls, publishes its aggregate last; after
the crash, fresh apps restore from it and the rollouts finish as attempt 1 without repeating a
completed model call.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import random
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import pytest

from model_servers.inference_worker.default_model_data import make_problem
from nemo_gym_ckpt.cli.arguments import MAX_SECONDS, seconds
from tests.support.episode_participants import TOKEN
from tests.support.rollout_mesh import DeterministicModel, calculator_answers, calculator_row, rollout_mesh

pytestmark = pytest.mark.unit

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "example_controller.py"
PROBLEMS = [make_problem(random.Random(900 + seed)) for seed in range(4)]
HELD = ("ex-0", "ex-1", "ex-3")


def load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("example_controller", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their annotations through it
    spec.loader.exec_module(module)
    return module


def model(hold: tuple[str, ...] = ()) -> DeterministicModel:
    def second_call(key: str | None, body: dict[str, Any]) -> bool:
        return key in hold and body["input"][-1].get("type") == "function_call_output"

    return DeterministicModel(calculator_answers({p["question"]: p for p in PROBLEMS}), hold=second_call)


async def until(condition: Any, what: str) -> None:
    deadline = time.monotonic() + 10
    while not condition():
        assert time.monotonic() < deadline, f"never: {what}"
        await asyncio.sleep(0.005)


async def test_the_example_controller_checkpoints_and_restores_with_plain_http(tmp_path: Path) -> None:
    script = load_script()
    root = tmp_path / "checkpoints"
    directory = root / "example"
    tasks = {f"ex-{i}": calculator_row(problem) for i, problem in enumerate(PROBLEMS)}
    held = model(HELD)
    async with (rollout_mesh("single_agent_turn", root, held) as served,
                httpx.AsyncClient(transport=served.placement.transport, timeout=30) as http):
        mesh = script.Mesh(http, served.urls["head"], TOKEN)
        kinds = sorted(p.kind for p in await mesh.discover())
        rollouts = script.Rollouts(mesh, tasks, {}, {})
        runs = [asyncio.create_task(rollouts.run({"rollout_id": rid, "attempt": 0})) for rid in tasks]
        await until(lambda: sum(held.holding.values()) == 3 and len(rollouts.results) == 1, "3 held")
        aggregate = await script.take_checkpoint(mesh, rollouts, directory, 10.0)
        abandoned = list(rollouts.in_flight.values())
        for run in runs:  # the controller goes away; it retires what it leaves behind
            run.cancel()
        await asyncio.gather(*runs, return_exceptions=True)
        await mesh.housekeeping("retire", "episode_ids", abandoned)
        retired = (await http.get(f"{served.urls['env']}/ng-control/v1/checkpoint/status",
                                  headers={"authorization": f"Bearer {TOKEN}"})).json()
    assert kinds == ["agent", "environment"]  # the model and calculator of this mesh are plain servers
    assert retired["retired_rollouts"] == 3 and retired["extras"]["episodes"] == 0
    assert sorted(e["rollout_id"] for e in aggregate["continued"]) == list(HELD)
    latest = (directory / "LATEST").read_text().strip()
    assert latest == aggregate["checkpoint_id"]
    assert json.loads((directory / latest / "controller.json").read_text())["tasks"] == tasks
    for manifest in aggregate["manifests"]:
        written = directory / latest / "gym" / manifest["kind"] / manifest["instance"] / "manifest.json"
        assert written.is_file()

    fresh = model()
    async with (rollout_mesh("single_agent_turn", root, fresh) as served,
                httpx.AsyncClient(transport=served.placement.transport, timeout=30) as http):
        mesh = script.Mesh(http, served.urls["head"], TOKEN)
        await mesh.discover()
        episodes, restored = await script.restore_checkpoint(mesh, directory, 10.0)
        again = script.Rollouts(mesh, restored["tasks"], {}, {})
        await asyncio.gather(*(again.run(episode) for episode in episodes))
        await mesh.housekeeping("forget", "rollout_ids", list(HELD))
        status = (await http.get(f"{served.urls['env']}/ng-control/v1/checkpoint/status",
                                 headers={"authorization": f"Bearer {TOKEN}"})).json()
    assert restored["restored"] == [f"{rid}-a1" for rid in HELD]
    assert {rid: (r["attempt"], r["status"], r["reward"]) for rid, r in again.results.items()} == {
        rid: (1, 200, 1.0) for rid in HELD}
    assert sorted(str(key) for key in fresh.capture_keys()) == [f"{rid}-a1" for rid in HELD]  # 2nd calls only
    assert status["extras"]["episodes"] == 0 and status["retired_rollouts"] == 0


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "-1", "0", "1e9", "abc"])
def test_a_timeout_that_is_no_duration_is_a_usage_error(
    value: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("GYM_CKPT_TOKEN", TOKEN)
    with pytest.raises(SystemExit) as exited:  # nan, inf and -1 were taken: deadlines never or long since reached
        load_script().main(["restore", "--head", "http://127.0.0.1:1", "--dir", "/tmp/ckpt", "--timeout-s", value])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err.startswith("usage: ") and "argument --timeout-s: " in err


def test_the_scripts_duration_rule_is_the_commands() -> None:
    script = load_script()  # written out in the script (nothing but httpx), so compared here
    assert script.MAX_SECONDS == MAX_SECONDS
    for value in ["1", "0.5", "120", "1e-9", "31536000", "31536000.5", "0", "-0", "-1", "nan", "inf", "1e9", "x"]:
        outcomes = []
        for parse in (script.seconds, seconds):
            try:
                outcomes.append(parse(value))
            except (argparse.ArgumentTypeError, ValueError) as error:
                outcomes.append(type(error).__name__)
        assert outcomes[0] == outcomes[1], value
