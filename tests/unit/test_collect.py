"""The collector in process: dispatch, rows, failures, metrics, resume, stop; and its pure parts."""

from __future__ import annotations

import argparse
import asyncio
import io
import os
import random
import signal
from pathlib import Path
from typing import Any

import orjson
import pytest
from fastapi import Request

from agents.simple_agent import app as agent_app
from environment_servers.single_agent_turn import app as env_app
from model_servers.inference_worker.default_model_data import make_problem
from nemo_gym_ckpt.cli import collect
from nemo_gym_ckpt.cli.exit_codes import ExitCode
from nemo_gym_ckpt.collect.progress import Progress, format_duration
from nemo_gym_ckpt.collect.rows import JsonlAppender, aggregate, failures_path, metrics_path, read_jsonl
from nemo_gym_ckpt.collect.tasks import read_tasks, resolve_input
from nemo_gym_ckpt.config import PROJECT_ROOT, DatasetConfig, ServerConfig, ServerRef
from nemo_gym_ckpt.identity import RolloutIdentity, current_identity
from nemo_gym_ckpt.server import create_app
from nemo_gym_ckpt.testing.scripted_model import ScriptedModel, calculator_policy
from nemo_gym_ckpt.testing.transports import InProcessMesh
from resources_servers.calculator_tools import app as calculator_app

pytestmark = pytest.mark.unit

PROBLEMS = [make_problem(random.Random(100 + seed)) for seed in range(6)]
TOOLS = [spec.definition() for spec in calculator_app.CalculatorTools.tool_specs.values()]


def row(problem: dict[str, Any]) -> dict[str, Any]:
    return {"responses_create_params": {"input": [{"role": "user", "content": problem["question"]}],
                                        "tools": TOOLS}, "expected_answer": problem["answer"]}


def build_mesh(gate: asyncio.Event | None = None, **env_settings: Any) -> tuple[InProcessMesh, ScriptedModel]:
    model = ScriptedModel(calculator_policy({p["question"]: p for p in PROBLEMS}))
    mesh = InProcessMesh({
        "policy_model": ("model_servers", "scripted", ServerConfig()),
        "calculator_tools": ("resources_servers", "calculator_tools", calculator_app.Config()),
        "simple_agent": ("agents", "simple_agent", agent_app.Config(
            model_server=ServerRef(type="model_servers", name="policy_model"),
            resources_server=ServerRef(type="resources_servers", name="calculator_tools"))),
        "env": ("environment_servers", "single_agent_turn", env_app.Config(
            agent=ServerRef(type="agents", name="simple_agent"),
            resources_server=ServerRef(type="resources_servers", name="calculator_tools"), **env_settings)),
    })
    mesh.serve("policy_model", model.app() if gate is None else _held_until(gate, model.app()))
    for name, module in (("calculator_tools", calculator_app), ("simple_agent", agent_app), ("env", env_app)):
        mesh.build(name, module.create_app)
    return mesh, model


def _held_until(gate: asyncio.Event, app: Any) -> Any:
    async def held(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            await asyncio.wait_for(gate.wait(), timeout=30)
        await app(scope, receive, send)

    return held


def plan_for(mesh: InProcessMesh, tasks: list[dict[str, Any]], output: Path, **kwargs: Any) -> collect.Plan:
    return collect.Plan("env", mesh.url_of("env"), tasks, output, **kwargs)


async def test_every_task_and_repeat_is_collected_with_its_indices(tmp_path: Path) -> None:
    mesh, model = build_mesh()
    output = tmp_path / "out.jsonl"
    tasks = [row(p) for p in PROBLEMS]
    stream = io.StringIO()
    summary = await collect.run_plan(plan_for(mesh, tasks, output, num_repeats=2, concurrency=3),
                                     mesh.client(), stream)
    rows = list(read_jsonl(output))
    assert summary.finished == 12 and summary.failed == 0 and summary.stopped_by is None
    assert sorted((r["_ng_task_index"], r["_ng_rollout_index"]) for r in rows) == [
        (t, r) for t in range(6) for r in range(2)]
    assert all(r["_ng_attempt_index"] == 0 and r["reward"] == 1.0 for r in rows)
    assert all(r["expected_answer"] == tasks[r["_ng_task_index"]]["expected_answer"] for r in rows)
    assert {call.capture_key for call in model.calls} == {f"{t}-{r}" for t in range(6) for r in range(2)}
    metrics = orjson.loads(metrics_path(output).read_bytes())
    assert metrics["mean_reward"] == 1.0 and metrics["rollouts"] == 12 and metrics["failures"] == 0
    assert "expected_answer" not in metrics["means"] and metrics["means"]["usage.input_tokens"] == 20.0
    assert "extracted_answer" in metrics["means"] and metrics["concurrency"] == 3
    assert "12/12" in stream.getvalue() and "mean reward 1.000" in stream.getvalue()
    assert not failures_path(output).read_bytes()
    await mesh.aclose()


async def test_rollouts_past_the_capacity_are_refused_up_front_and_sent_again(tmp_path: Path) -> None:
    gate = asyncio.Event()
    mesh, model = build_mesh(gate, max_rollouts_in_flight=2)
    client = mesh.client()
    held = [asyncio.create_task(client.request("POST", mesh.url_of("env") + "/run", json=row(PROBLEMS[n]),
                                                identity=RolloutIdentity(f"held-{n}"), check=False))
            for n in range(3)]
    done, _ = await asyncio.wait(held, timeout=30, return_when=asyncio.FIRST_COMPLETED)
    [refused] = [task.result() for task in done]  # two run (held at the model), the third is refused
    assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["code"] == "capacity_exceeded"
    gate.set()
    replies = await asyncio.gather(*held)
    started = {f"held-{n}" for n, reply in enumerate(replies) if reply.status_code == 200}
    assert len(started) == 2 and {call.capture_key for call in model.calls} == started  # nothing else started
    output = tmp_path / "out.jsonl"
    summary = await collect.run_plan(plan_for(mesh, [row(p) for p in PROBLEMS], output, concurrency=6),
                                     client, io.StringIO())
    assert summary.finished == 6 and summary.failed == 0 and summary.refused > 0
    assert len(list(read_jsonl(output))) == 6


async def test_failures_are_written_with_their_reason(tmp_path: Path) -> None:
    mesh, _ = build_mesh()
    output = tmp_path / "out.jsonl"
    tasks = [row(PROBLEMS[0]), {**row(PROBLEMS[1]), "expected_answer": "many"}, {"no": "params"}]
    summary = await collect.run_plan(plan_for(mesh, tasks, output), mesh.client(), io.StringIO())
    assert summary.finished == 1 and summary.failed == 2
    failures = sorted(read_jsonl(failures_path(output)), key=lambda r: r["_ng_task_index"])
    assert [f["_ng_task_index"] for f in failures] == [1, 2]
    assert failures[0]["_ng_failure_class"] == "invalid_request"
    assert failures[0]["_ng_failure_reason"].startswith("step verify failed")
    assert failures[1]["no"] == "params" and "responses_create_params" in failures[1]["_ng_failure_reason"]
    assert collect._exit_status(summary) == 0
    await mesh.aclose()


async def test_a_second_run_skips_finished_rows_and_redoes_a_torn_one(tmp_path: Path) -> None:
    mesh, model = build_mesh()
    output = tmp_path / "out.jsonl"
    tasks = [row(p) for p in PROBLEMS[:3]]
    await collect.run_plan(plan_for(mesh, tasks, output), mesh.client(), io.StringIO())
    calls = len(model.calls)
    again = await collect.run_plan(plan_for(mesh, tasks, output), mesh.client(), io.StringIO())
    assert again.skipped == 3 and again.finished == 0 and len(model.calls) == calls
    data = output.read_bytes()
    output.write_bytes(data[: data.rindex(b"\n", 0, len(data) - 1) + 1] + b'{"torn": ')  # crash mid-row
    third = await collect.run_plan(plan_for(mesh, tasks, output), mesh.client(), io.StringIO())
    assert third.skipped == 2 and third.finished == 1
    assert len(list(read_jsonl(output))) == 3 and output.read_bytes().endswith(b"\n")
    await mesh.aclose()


async def test_sigint_stops_dispatch_cancels_in_flight_and_keeps_rows(tmp_path: Path) -> None:
    mesh, _ = build_mesh()
    arrived: list[str] = []
    cancelled: list[str] = []
    third = asyncio.Event()
    env = create_app("env")

    @env.post("/run")
    async def run(request: Request) -> dict[str, Any]:
        key = current_identity().capture_key  # type: ignore[union-attr]
        arrived.append(key)
        if key == "1-0":
            return {**(await request.json()), "reward": 1.0}
        try:
            if key == "0-0":
                await third.wait()  # 2-0 is dispatched only after 1-0's row is written
                os.kill(os.getpid(), signal.SIGINT)
            else:
                third.set()
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.append(key)
            raise
        return {}

    mesh.serve("env", env)
    output = tmp_path / "out.jsonl"
    tasks = [row(p) for p in PROBLEMS]
    async with asyncio.timeout(10):
        summary = await collect.run_plan(plan_for(mesh, tasks, output, concurrency=2), mesh.client(),
                                         io.StringIO())
    assert summary.stopped_by == "SIGINT" and sorted(cancelled) == ["0-0", "2-0"]
    assert arrived == ["0-0", "1-0", "2-0"]  # dispatch stopped
    assert summary.finished == 1 and [r["_ng_task_index"] for r in read_jsonl(output)] == [1]
    assert collect._exit_status(summary) == ExitCode.INTERRUPTED
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_progress_shows_rate_eta_failures_and_reward() -> None:
    now = [0.0]
    stream = io.StringIO()
    progress = Progress(10, stream, clock=lambda: now[0], interactive=False, line_every_s=5)
    now[0] = 2.0
    progress.advance(reward=1.0)
    now[0] = 4.0
    progress.advance(failed=True)
    line = progress.render()
    assert "2/10" in line and "1 failed" in line and "0.50 rollouts/s" in line and "ETA 16s" in line
    assert "mean reward 1.000" in line
    assert stream.getvalue().count("\n") == 1  # non-interactive: one line per interval
    progress.close()
    progress.close()
    assert stream.getvalue().count("\n") == 2  # the last state, once
    tty = io.StringIO()
    Progress(1, tty, interactive=True).advance()
    assert tty.getvalue().startswith("\r[") and "ETA 0s" in tty.getvalue()
    assert [format_duration(s) for s in (5, 75, 3725)] == ["5s", "1m15s", "1h02m"]


def test_appender_cuts_a_torn_tail_and_reader_names_bad_lines(tmp_path: Path) -> None:
    path = tmp_path / "rows.jsonl"
    path.write_bytes(b'{"a": 1}\n{"b": 2')
    with JsonlAppender(path) as appender:
        appender.append({"c": 3})
    assert list(read_jsonl(path)) == [{"a": 1}, {"c": 3}]
    path.write_bytes(b'{"a": 1}\n[1]\n')
    with pytest.raises(ValueError, match="line 2"):
        list(read_jsonl(path))
    path.write_bytes(b'{"a": 1}\n{"b": 2}')  # a hand-written last line without newline
    assert len(list(read_jsonl(path))) == 2 and len(list(read_jsonl(path, complete_lines_only=True))) == 1
    assert list(read_jsonl(tmp_path / "absent.jsonl")) == []
    assert failures_path(Path("x/out.jsonl")) == Path("x/out_failures.jsonl")
    assert metrics_path(Path("out")) == Path("out_aggregate_metrics.json")


def test_aggregate_means_only_what_the_rollouts_added() -> None:
    rows = [{"reward": 1.0, "expected_answer": 4, "ok": True, "name": "x", "_ng_task_index": 0,
             "response": {"usage": {"input_tokens": 10, "input_tokens_details": {"cached_tokens": 0}}}},
            {"reward": 0.0, "expected_answer": 9, "ok": False, "_ng_task_index": 1}]
    metrics = aggregate(rows, task_fields={"expected_answer"}, failures=1)
    assert metrics == {"rollouts": 2, "failures": 1, "mean_reward": 0.5,
                       "means": {"ok": 0.5, "reward": 0.5, "usage.input_tokens": 10.0}}
    assert aggregate([])["mean_reward"] is None


def test_environment_and_input_resolution(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert collect.pick_environment(["a"], None) == "a"
    assert collect.pick_environment(["a", "b"], "b") == "b"
    with pytest.raises(collect.UsageError, match="--environment"):
        collect.pick_environment(["a", "b"], None)
    with pytest.raises(collect.UsageError, match="no environment server named 'c'"):
        collect.pick_environment(["a"], "c")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "local.jsonl").write_text("{}\n")
    assert resolve_input(Path("local.jsonl")) == tmp_path / "local.jsonl"
    quickstart = Path("resources_servers/calculator_tools/data/quickstart.jsonl")
    assert resolve_input(quickstart) == PROJECT_ROOT / quickstart  # the project root next
    with pytest.raises(collect.UsageError, match="not found"):
        resolve_input(Path("missing.jsonl"))
    with pytest.raises(collect.UsageError, match="no task rows"):
        read_tasks(_empty(tmp_path), None)
    assert len(read_tasks(PROJECT_ROOT / quickstart, 7)) == 7


def _empty(tmp_path: Path) -> Path:
    path = tmp_path / "empty.jsonl"
    path.write_text("\n")
    return path


def test_the_default_input_is_the_environments_first_dataset() -> None:
    mesh, _ = build_mesh()
    with pytest.raises(collect.UsageError, match="declares no datasets"):
        collect.default_input(mesh.mesh, "env")
    with pytest.raises(collect.UsageError, match="pass --input"):
        collect.default_input(None, "env")
    settings = mesh.mesh.instance("env").settings
    settings.datasets.append(DatasetConfig(name="q", jsonl_fpath=Path("data/q.jsonl")))
    assert collect.default_input(mesh.mesh, "env") == Path("data/q.jsonl")


@pytest.mark.parametrize(
    ("argv", "message"),
    [([], "--config CONFIG"), (["--head", "http://127.0.0.1:9", "a=1"], "need --config")],
)
def test_usage_errors_exit_2(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    collect.configure(parser)
    assert collect.main(parser.parse_args([*argv, "--output", "out.jsonl"])) == 2
    assert message in capsys.readouterr().err


def test_an_unreachable_head_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    collect.configure(parser)
    args = parser.parse_args(["--head", "http://127.0.0.1:9", "--output", "out.jsonl"])
    assert collect.main(args) == 1
    assert "cannot list the servers of http://127.0.0.1:9" in capsys.readouterr().err


def test_flags_refuse_non_positive_counts() -> None:
    parser = argparse.ArgumentParser()
    collect.configure(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--output", "o", "--concurrency", "0"])
