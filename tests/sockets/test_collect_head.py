"""``collect --head``: the command against a running mesh of real uvicorn servers (threads, sockets).

The policy model is scripted (the real route, a Python policy); the agent, the environment, the
calculator tools and the head server are the real apps.
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import orjson
import pytest

from agents.simple_agent import app as agent_app
from environment_servers.single_agent_turn import app as env_app
from model_servers.inference_worker.default_model_data import make_problem
from nemo_gym_ckpt.cli import collect
from nemo_gym_ckpt.collect.rows import metrics_path, read_jsonl
from nemo_gym_ckpt.config import (
    CheckpointConfig,
    HeadServerConfig,
    MeshConfig,
    ServerConfig,
    ServerInstance,
    ServerRef,
)
from nemo_gym_ckpt.context import ServerContext
from nemo_gym_ckpt.launch.head import ThreadedServer, create_head_app
from nemo_gym_ckpt.launch.launcher import find_free_port
from nemo_gym_ckpt.testing.scripted_model import ScriptedModel, calculator_policy
from resources_servers.calculator_tools import app as calculator_app

pytestmark = pytest.mark.sockets

PROBLEMS = [make_problem(random.Random(500 + seed)) for seed in range(5)]
TOOLS = [spec.definition() for spec in calculator_app.CalculatorTools.tool_specs.values()]
SETTINGS: dict[str, tuple[Any, str, ServerConfig]] = {
    "policy_model": ("responses_api_models", "scripted", ServerConfig()),
    "calculator_tools": ("resources_servers", "calculator_tools", calculator_app.Config()),
    "simple_agent": ("responses_api_agents", "simple_agent", agent_app.Config(
        model_server=ServerRef(type="responses_api_models", name="policy_model"),
        resources_server=ServerRef(type="resources_servers", name="calculator_tools"))),
    "env": ("environment_servers", "single_agent_turn", env_app.Config(
        agent_server=ServerRef(type="responses_api_agents", name="simple_agent"),
        resources_server=ServerRef(type="resources_servers", name="calculator_tools"))),
}


def mesh_on_free_ports() -> MeshConfig:
    taken: set[int] = set()
    instances = {}
    for name, (server_type, implementation, settings) in SETTINGS.items():
        port = find_free_port("127.0.0.1", taken)
        taken.add(port)
        placed = settings.model_copy(update={"port": port})
        instances[name] = ServerInstance(name, server_type, implementation, placed)
    return MeshConfig(HeadServerConfig(port=0), CheckpointConfig(), instances, raw={})


@pytest.fixture
def head() -> Iterator[tuple[str, ScriptedModel]]:
    mesh = mesh_on_free_ports()
    model = ScriptedModel(calculator_policy({p["question"]: p for p in PROBLEMS}))
    apps = {
        "policy_model": model.app(),
        "calculator_tools": calculator_app.create_app(_ctx(mesh, "calculator_tools")),
        "simple_agent": agent_app.create_app(_ctx(mesh, "simple_agent")),
        "env": env_app.create_app(_ctx(mesh, "env")),
    }
    with ExitStack() as stack:
        for name, app in apps.items():
            stack.enter_context(ThreadedServer(app, port=mesh.instance(name).settings.port or 0, name=name))
        head_server = stack.enter_context(ThreadedServer(create_head_app(mesh), name="head"))
        yield head_server.url, model


def _ctx(mesh: MeshConfig, name: str) -> ServerContext[Any]:
    return ServerContext(name, mesh.instance(name).settings, mesh)


def args_for(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    collect.configure(parser)
    return parser.parse_args(list(argv))


def test_collect_against_a_running_mesh(
    head: tuple[str, ScriptedModel], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url, model = head
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_bytes(b"".join(orjson.dumps({
        "responses_create_params": {"input": [{"role": "user", "content": p["question"]}], "tools": TOOLS},
        "expected_answer": p["answer"]}) + b"\n" for p in PROBLEMS))
    output = tmp_path / "out" / "rollouts.jsonl"
    status = collect.main(args_for("--head", url, "--input", str(tasks), "--output", str(output),
                                   "--limit", "4", "--num-repeats", "2", "--concurrency", "3"))
    captured = capsys.readouterr()
    assert status == 0, captured.err
    rows = list(read_jsonl(output))
    assert len(rows) == 8 and all(row["reward"] == 1.0 for row in rows)
    assert {(row["_ng_task_index"], row["_ng_rollout_index"]) for row in rows} == {
        (t, r) for t in range(4) for r in range(2)}
    assert "mean reward 1.0000 over 8 rollouts" in captured.out
    assert "8/8" in captured.err and "rollouts/s" in captured.err
    (entry,) = orjson.loads(metrics_path(output).read_bytes())
    assert entry["key_metrics"]["mean/reward"] == 1.0 and entry["_ng_environment_server"] == "env"
    assert {call.capture_key for call in model.calls} == {f"{t}-{r}" for t in range(4) for r in range(2)}
    # a second run finds nothing left to do
    assert collect.main(args_for("--head", url, "--input", str(tasks), "--output", str(output),
                                 "--limit", "4", "--num-repeats", "2")) == 0
    assert f"nothing left: all 8 rollouts are in {output}" in capsys.readouterr().out
    assert len(list(read_jsonl(output))) == 8


def test_an_unknown_environment_is_a_usage_error(
    head: tuple[str, ScriptedModel], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url, _ = head
    status = collect.main(args_for("--head", url, "--environment", "nope", "--input", "x.jsonl",
                                   "--output", str(tmp_path / "o.jsonl")))
    assert status == 2 and "no environment server named 'nope'" in capsys.readouterr().err
