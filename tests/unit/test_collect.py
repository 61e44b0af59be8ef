"""The collector in process: dispatch, rows, failures, metrics, resume, stop; and its pure parts."""

from __future__ import annotations

import argparse
import asyncio
import io
import os
import random
import signal
from pathlib import Path
from typing import Any, cast

import orjson
import pytest
from fastapi import Request

from agents.simple_agent import app as agent_app
from environment_servers.single_agent_turn import app as env_app
from model_servers.inference_worker.default_model_data import make_problem
from nemo_gym_ckpt.checkpoint.coordinator import global_config_of
from nemo_gym_ckpt.checkpoint.fileops import NotRegularFile
from nemo_gym_ckpt.cli import collect
from nemo_gym_ckpt.cli.exit_codes import ExitCode
from nemo_gym_ckpt.collect.dispatch import HeldBack
from nemo_gym_ckpt.collect.progress import Progress, format_duration
from nemo_gym_ckpt.collect.rows import (
    JsonlAppender,
    failures_path,
    materialized_path,
    metrics_path,
    read_jsonl,
    summarize,
)
from nemo_gym_ckpt.collect.tasks import read_tasks, resolve_input
from nemo_gym_ckpt.config import PROJECT_ROOT, DatasetConfig, ServerConfig, ServerRef, load_config
from nemo_gym_ckpt.errors import StopRequested, UpstreamError
from nemo_gym_ckpt.identity import RolloutIdentity, current_identity
from nemo_gym_ckpt.launch.head import global_config_yaml
from nemo_gym_ckpt.launch.launcher import MeshLauncher
from nemo_gym_ckpt.server import create_app
from nemo_gym_ckpt.testing.scripted_model import ScriptedModel, calculator_policy
from nemo_gym_ckpt.testing.transports import InProcessMesh
from nemo_gym_ckpt.testing.waits import until
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
        "policy_model": ("responses_api_models", "scripted", ServerConfig()),
        "calculator_tools": ("resources_servers", "calculator_tools", calculator_app.Config()),
        "simple_agent": ("responses_api_agents", "simple_agent", agent_app.Config(
            model_server=ServerRef(type="responses_api_models", name="policy_model"),
            resources_server=ServerRef(type="resources_servers", name="calculator_tools"))),
        "env": ("environment_servers", "single_agent_turn", env_app.Config(
            agent_server=ServerRef(type="responses_api_agents", name="simple_agent"),
            resources_server=ServerRef(type="resources_servers", name="calculator_tools"), **env_settings)),
    })
    mesh.serve("policy_model", model.app() if gate is None else _held_until(gate, model.app()))
    for name, module in (("calculator_tools", calculator_app), ("simple_agent", agent_app), ("env", env_app)):
        mesh.build(name, module.create_app)
    return mesh, model


AGENT_REF = {"type": "responses_api_agents", "name": "simple_agent"}
STAMPS = {"_ng_environment_server": "env", "_ng_result_type": "single_agent_turn"}


def _held_until(gate: asyncio.Event, app: Any) -> Any:
    async def held(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            await asyncio.wait_for(gate.wait(), timeout=30)
        await app(scope, receive, send)

    return held


def plan_for(mesh: InProcessMesh, tasks: list[dict[str, Any]], output: Path, **kwargs: Any) -> collect.Plan:
    kwargs = {"result_type": "single_agent_turn", "agent_ref": AGENT_REF, **kwargs}
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
    assert all(r["agent_ref"] == AGENT_REF and r.items() >= STAMPS.items() for r in rows)
    # the collector's keys come last, in NeMo Gym's order (agent_ref stays where the reply has it)
    assert all(list(r)[-5:] == ["_ng_task_index", "_ng_rollout_index", "_ng_attempt_index", *STAMPS] for r in rows)
    materialized = list(read_jsonl(materialized_path(output)))
    assert materialized == [{**tasks[t], "agent_ref": AGENT_REF, "_ng_task_index": t, "_ng_rollout_index": r}
                            for t in range(6) for r in range(2)]
    (entry,) = orjson.loads(metrics_path(output).read_bytes())  # NeMo Gym's layout: one entry per server
    assert list(entry) == ["agent_ref", "_ng_environment_server", "agent_metrics", "key_metrics",
                           "group_level_metrics", "repeat_level_metrics"]
    assert entry["agent_ref"] == {"name": "simple_agent"} and entry["_ng_environment_server"] == "env"
    assert entry["key_metrics"]["mean/reward"] == 1.0 and entry["agent_metrics"]["num_repeats"] == 2
    assert [g["_ng_task_index"] for g in entry["group_level_metrics"]] == list(range(6))
    assert all(g["num_rollouts"] == 2 for g in entry["group_level_metrics"])
    assert [r["_ng_rollout_index"] for r in entry["repeat_level_metrics"]] == [0, 1]
    metrics = summary.metrics
    assert metrics["mean_reward"] == 1.0 and metrics["rollouts"] == 12 and metrics["failures"] == 0
    assert "expected_answer" not in metrics["means"] and metrics["means"]["usage.input_tokens"] == 20.0
    assert "extracted_answer" in metrics["means"] and metrics["concurrency"] == 3
    assert "12/12" in stream.getvalue() and "mean reward 1.000" in stream.getvalue()
    assert not failures_path(output).read_bytes()
    assert collect._exit_status(plan_for(mesh, tasks, output), summary) == ExitCode.OK
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


FAILURE_KEYS = ["_ng_failure_class", "_ng_failure_type", "_ng_failure_message", "_ng_failure_http_status",
                "_ng_failure_response_body", "_ng_task_index", "_ng_rollout_index", "agent_ref",
                "_ng_attempt_index", "_ng_environment_server", "_ng_result_type"]


async def test_failures_are_written_as_nemo_gym_writes_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    mesh, _ = build_mesh()
    output = tmp_path / "out.jsonl"
    tasks = [row(PROBLEMS[0]), {**row(PROBLEMS[1]), "expected_answer": "many"}, {"no": "params"}]
    plan = plan_for(mesh, tasks, output)
    summary = await collect.run_plan(plan, mesh.client(), io.StringIO())
    assert summary.finished == 1 and summary.failed == 2
    failures = sorted(read_jsonl(failures_path(output)), key=lambda r: r["_ng_task_index"])
    assert [list(f) for f in failures] == [FAILURE_KEYS, FAILURE_KEYS]  # no task fields, no reward
    assert [f["_ng_task_index"] for f in failures] == [1, 2]
    first, second = failures
    assert (first["_ng_failure_class"], first["_ng_failure_type"], first["_ng_failure_http_status"]) == (
        "agent_run_error", "InvalidRequest", 400)
    assert first["_ng_failure_message"].startswith("step verify failed")
    assert orjson.loads(first["_ng_failure_response_body"])["error"]["code"] == "invalid_request"
    assert "responses_create_params" in second["_ng_failure_message"]
    assert collect._exit_status(plan, summary) == ExitCode.FAILURE
    line = capsys.readouterr().err.strip()
    assert "2 of 3 rollouts failed (2 invalid_request)" in line and "1 finished" in line and "\n" not in line
    await mesh.aclose()


async def test_an_unreachable_environment_and_a_reported_failure_are_failure_rows(tmp_path: Path) -> None:
    """No reply at all: ``agent_request_failed`` with no status; a 200 reply naming ``_ng_failure_class``
    is a failure too, kept as the environment wrote it."""
    mesh, _ = build_mesh()
    env = create_app("env")

    @env.post("/run")
    async def run(request: Request) -> dict[str, Any]:
        body = await request.json()
        if body["_ng_task_index"] == 0:
            return {"_ng_failure_class": "environment_server_failed", "_ng_failure_message": "no"}
        return {**body, "reward": 1.0}

    mesh.serve("env", env)
    output = tmp_path / "out.jsonl"
    summary = await collect.run_plan(plan_for(mesh, [row(PROBLEMS[0]), row(PROBLEMS[1])], output),
                                     mesh.client(), io.StringIO())
    assert summary.finished == 1 and dict(summary.failure_codes) == {"environment_server_failed": 1}
    (reported,) = read_jsonl(failures_path(output))
    assert reported["_ng_failure_message"] == "no" and reported["_ng_environment_server"] == "env"
    gone = collect.Plan("env", "http://127.0.0.1:9", [row(PROBLEMS[0])], tmp_path / "gone.jsonl")
    summary = await collect.run_plan(gone, stream=io.StringIO())
    (failure,) = read_jsonl(failures_path(tmp_path / "gone.jsonl"))
    assert (failure["_ng_failure_class"], failure["_ng_failure_type"]) == ("agent_request_failed", "Unavailable")
    assert failure["_ng_failure_http_status"] is None and failure["_ng_failure_response_body"] is None
    assert "agent_ref" not in failure and summary.failure_codes == {"unavailable": 1}
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
    assert collect._exit_status(plan_for(mesh, tasks, output), summary) == ExitCode.INTERRUPTED
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


async def test_a_watch_reason_stops_the_run_and_names_itself(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """What a launched collection does when a server dies: ``watch`` (the launcher's ``exited``) answers
    a reason, the rollouts in flight are cancelled, the rows kept, and the exit line names the server."""
    mesh, _ = build_mesh()
    gate = asyncio.Event()
    env = create_app("env")

    @env.post("/run")
    async def run(request: Request) -> dict[str, Any]:
        body = await request.json()
        if body["_ng_task_index"] == 0:
            gate.set()
            return {**body, "reward": 1.0}
        await asyncio.sleep(30)
        return {}

    mesh.serve("env", env)
    output = tmp_path / "out.jsonl"
    plan = plan_for(mesh, [row(p) for p in PROBLEMS], output, concurrency=2)
    async with asyncio.timeout(10):
        summary = await collect.run_plan(plan, mesh.client(), io.StringIO(),
                                         watch=lambda: "simple_agent exited with status -9" if gate.is_set() else None)
    assert summary.stopped_by == "simple_agent exited with status -9" and summary.finished == 1
    assert [r["_ng_task_index"] for r in read_jsonl(output)] == [0]
    assert collect._exit_status(plan, summary) == ExitCode.FAILURE
    line = capsys.readouterr().err.strip()
    assert line.startswith("nemo-gym-ckpt collect: simple_agent exited with status -9 during the collection: "
                           "stopped the mesh; 5 rollouts not run") and "\n" not in line
    await mesh.aclose()


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


@pytest.mark.timeout(10)  # before, the appender opened a FIFO and its writes blocked once its buffer filled
def test_appender_and_reader_refuse_a_fifo_and_a_device_before_anything_blocks(tmp_path: Path) -> None:
    fifo, device, linked = tmp_path / "fifo.jsonl", tmp_path / "device.jsonl", tmp_path / "linked.jsonl"
    os.mkfifo(fifo)
    device.symlink_to("/dev/zero")  # read to its end, it never ends
    linked.symlink_to(tmp_path / "rows.jsonl")
    for path, what in ((fifo, "a FIFO"), (device, "a character device")):
        with pytest.raises(NotRegularFile, match=rf"not a regular file \({what}\)"):
            JsonlAppender(path)
        with pytest.raises(NotRegularFile, match=rf"not a regular file \({what}\)"):
            list(read_jsonl(path))
    with JsonlAppender(linked) as appender:  # a symlink to a regular file is the user's choice
        appender.append({"a": 1})
    assert list(read_jsonl(linked)) == [{"a": 1}]


def test_summary_means_only_what_the_rollouts_added() -> None:
    rows = [{"reward": 1.0, "expected_answer": 4, "ok": True, "name": "x", "_ng_task_index": 0,
             "response": {"usage": {"input_tokens": 10, "input_tokens_details": {"cached_tokens": 0}}}},
            {"reward": 0.0, "expected_answer": 9, "ok": False, "_ng_task_index": 1}]
    metrics = summarize(rows, task_fields={"expected_answer"}, failures=1)
    assert metrics == {"rollouts": 2, "failures": 1, "mean_reward": 0.5,
                       "means": {"ok": 0.5, "reward": 0.5, "usage.input_tokens": 10.0}}
    assert summarize([])["mean_reward"] is None


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
    agent = mesh.mesh.instance("simple_agent").settings
    agent.datasets.append(DatasetConfig(name="a", type="example", jsonl_fpath=Path("data/a.jsonl")))
    assert collect.default_input(mesh.mesh, "env") == Path("data/a.jsonl")  # NeMo Gym keeps them on agents
    settings = mesh.mesh.instance("env").settings
    settings.datasets.append(DatasetConfig(name="q", type="example", jsonl_fpath=Path("data/q.jsonl")))
    assert collect.default_input(mesh.mesh, "env") == Path("data/q.jsonl")  # the environment's come first


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


@pytest.mark.parametrize("flag", ["--rollout-timeout-s", "--ready-timeout-s", "--checkpoint-every-s",
                                  "--checkpoint-timeout-s"])
@pytest.mark.parametrize("value", ["inf", "nan", "-1", "0", "1e9"])
def test_durations_are_positive_finite_and_bounded(flag: str, value: str) -> None:
    parser = argparse.ArgumentParser()
    collect.configure(parser)
    with pytest.raises(SystemExit):  # a duration without a bound would be a deadline never reached
        parser.parse_args(["--output", "o", f"{flag}={value}"])
    assert getattr(parser.parse_args(["--output", "o", f"{flag}=2.5"]), flag[2:].replace("-", "_")) == 2.5


async def test_held_back_rollouts_wait_for_their_release(tmp_path: Path) -> None:
    mesh, model = build_mesh()
    output = tmp_path / "out.jsonl"
    held = HeldBack(2, asyncio.Event())
    run = asyncio.create_task(collect.run_plan(plan_for(mesh, [row(p) for p in PROBLEMS], output, concurrency=3),
                                               mesh.client(), io.StringIO(), held_back=held))
    await until(lambda: len(list(read_jsonl(output, complete_lines_only=True))) == 4, "the first four rows")
    for _ in range(50):
        await asyncio.sleep(0)
    assert not run.done() and {call.capture_key for call in model.calls} == {f"{t}-0" for t in range(4)}
    held.release.set()
    summary = await asyncio.wait_for(run, 30)
    assert summary.finished == 6 and {call.capture_key for call in model.calls} == {f"{t}-0" for t in range(6)}
    await mesh.aclose()


def test_rows_are_stamped_with_the_agent_the_environment_fronts_from_config_or_head() -> None:
    mesh = load_config([PROJECT_ROOT / "configs/quickstart.yaml"], ["head_server.port=0"])
    assert collect.environment_servers(mesh)["single_agent_turn"].agent_ref == AGENT_REF
    # --head: what our head's NeMo Gym config route answers, read back as NeMo Gym's collector reads it
    reply = orjson.dumps(global_config_yaml(mesh))
    assert collect.agent_refs_in_config(global_config_of(reply)) == {"single_agent_turn": AGENT_REF}
    assert collect.agent_refs_in_config({"env": {"environment_servers": {"x": {"agent_server": "a"}}}}) == {}


class _StartInterrupted:
    """A launcher whose start gets a signal, as a Ctrl-C or a SIGTERM while the mesh starts."""

    def __init__(self, signum: signal.Signals) -> None:
        self.signum, self.stop_requested = signum, False

    def request_stop(self) -> None:
        self.stop_requested = True

    def start(self, ready_timeout_s: float) -> None:
        signal.raise_signal(self.signum)
        if self.stop_requested:
            raise StopRequested("stopped before the mesh was ready")


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_while_the_mesh_starts_stops_it_by_name_and_restores_the_handlers(
    signum: signal.Signals, capsys: pytest.CaptureFixture[str]
) -> None:
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    launcher = _StartInterrupted(signum)
    assert collect._start(cast(MeshLauncher, launcher), 1.0, Path("log"), None) == ExitCode.INTERRUPTED
    assert launcher.stop_requested and f"stopped by {signum.name} before" in capsys.readouterr().err
    assert {sig: signal.getsignal(sig) for sig in before} == before


BOMB = "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{chr(98 + level)}: &{chr(98 + level)} [{', '.join([f'*{chr(97 + level)}'] * 10)}]\n" for level in range(6))


@pytest.mark.parametrize(
    ("text", "message"),
    [(BOMB, "builds more than"),  # 10**7 values from a few hundred bytes
     (f"a: {'9' * 5_000}\n", "int scalar of 5,000 characters"),  # were ValueErrors out of PyYAML
     ("a: !!int 1e3\n", "'1e3' is not a valid int"),
     ("a: 1\na: 2\n", "duplicate key 'a'")],
    ids=["alias bomb", "5,000-digit int", "unbuildable int", "duplicate key"],
)
def test_a_head_config_reply_past_the_bounds_is_an_upstream_error(text: str, message: str) -> None:
    with pytest.raises(UpstreamError, match=f"not a JSON string of YAML: .*{message}"):
        global_config_of(orjson.dumps(text))
