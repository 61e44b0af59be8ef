"""``nemo-gym-ckpt collect``: rollout collection over a mesh (checkpointing comes later).

    nemo-gym-ckpt collect --config configs/quickstart.yaml --output out.jsonl
        [--input TASKS.jsonl] [--limit N] [--num-repeats K] [--concurrency C]
        [--environment NAME] [--head URL] [key=value ...]

With ``--config`` the collector launches the mesh itself (``MeshLauncher``; server logs go to
``<output>_servers.log``) and stops it at the end; with ``--head URL`` it uses a running mesh, found
through ``GET {head}/servers``. The environment server is the config's (or the head's) only one, or
``--environment NAME``. ``--input`` defaults to the first dataset that environment declares
(relative paths are tried against the working directory, then the project root).

Each task row is dispatched ``--num-repeats`` times as ``POST {environment}/ng-rollout/<id>/run``
with rollout id ``"{task_index}-{rollout_index}"``, at most ``--concurrency`` at a time. Finished
rows are appended to the output as they come (``rollouts.py``); failures go to
``<output>_failures.jsonl`` with their reason. Rollouts already in the output are not run again, so a
run that was stopped picks up where it left off. At the end the mean reward and the mean of every
numeric field the rollouts added are printed and written to ``<output>_aggregate_metrics.json``.

Ctrl-C (or SIGTERM) stops dispatching, cancels the rollouts in flight, keeps every row already
written, stops the mesh it launched and exits 130 (1 for SIGTERM) with a one-line reason.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TextIO

import httpx
import orjson

from nemo_gym_ckpt.client import MeshClient
from nemo_gym_ckpt.config import MeshConfig, load_config
from nemo_gym_ckpt.errors import GymError, UpstreamError
from nemo_gym_ckpt.identity import RolloutIdentity
from nemo_gym_ckpt.launch import LaunchError, MeshLauncher, StopRequested, stop_on_signals
from nemo_gym_ckpt.progress import Progress
from nemo_gym_ckpt.rollouts import (
    JsonlAppender,
    RolloutKey,
    aggregate,
    failure_row,
    failures_path,
    metrics_path,
    output_row,
    read_jsonl,
    rollout_id,
    rollout_key,
)

__all__ = [
    "PROJECT_ROOT",
    "CollectFailed",
    "Plan",
    "Summary",
    "UsageError",
    "collect",
    "configure",
    "main",
    "resolve_input",
    "run_plan",
]

PROG = "nemo-gym-ckpt collect"
PROJECT_ROOT = Path(__file__).resolve().parent.parent
ENVIRONMENT_TYPE: Literal["environment_servers"] = "environment_servers"
EXIT_INTERRUPTED = 130


class UsageError(Exception):
    """A flag combination or an input that cannot work; exit status 2."""


class CollectFailed(Exception):
    """The collection cannot go on (e.g. the head server does not answer); exit status 1."""


def configure(parser: argparse.ArgumentParser) -> None:
    parser.description = "Collect rollouts: one /run per task row and repeat, rows appended to --output."
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, as for run")
    parser.add_argument("--config", action="append", default=[], metavar="CONFIG",
                        help="mesh YAML to launch (repeat to merge several)")
    parser.add_argument("--head", metavar="URL", help="use the running mesh of this head server instead")
    parser.add_argument("--input", type=Path, help="task rows (default: the environment's first dataset)")
    parser.add_argument("--output", type=Path, required=True, help="rollout rows are appended here")
    parser.add_argument("--environment", help="the environment server to use, if the mesh has several")
    parser.add_argument("--limit", type=_positive, help="use only the first N task rows")
    parser.add_argument("--num-repeats", type=_positive, default=1, help="rollouts per task row (default 1)")
    parser.add_argument("--concurrency", type=_positive, default=8, help="rollouts in flight (default 8)")
    parser.add_argument("--rollout-timeout-s", type=float, default=3600.0, help="deadline of one rollout")
    parser.add_argument("--ready-timeout-s", type=float, default=300.0, help="deadline for the mesh to start")


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


# ---- the plan ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    """Everything one collection needs, resolved."""

    environment: str
    environment_url: str
    tasks: list[dict[str, Any]]
    output: Path
    num_repeats: int = 1
    concurrency: int = 8
    rollout_timeout_s: float = 3600.0

    def rollouts(self) -> list[RolloutKey]:
        return [(task, rollout) for task in range(len(self.tasks)) for rollout in range(self.num_repeats)]


def resolve_input(path: Path) -> Path:
    """``path`` as given if absolute; else against the working directory, then the project root."""
    candidates = [path] if path.is_absolute() else [Path.cwd() / path, PROJECT_ROOT / path]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    raise UsageError(f"input file {path} not found (tried {', '.join(str(c) for c in candidates)})")


def read_tasks(path: Path, limit: int | None) -> list[dict[str, Any]]:
    try:
        tasks = list(read_jsonl(path))
    except ValueError as error:
        raise UsageError(str(error)) from None
    tasks = tasks[:limit] if limit else tasks
    if not tasks:
        raise UsageError(f"{path} holds no task rows")
    return tasks


def pick_environment(available: list[str], wanted: str | None) -> str:
    if wanted is not None:
        if wanted not in available:
            raise UsageError(f"no environment server named {wanted!r}; the mesh has {available or 'none'}")
        return wanted
    if len(available) != 1:
        choices = ", ".join(available) or "none"
        count = len(available)
        raise UsageError(f"pass --environment NAME: the mesh has {count} environment servers ({choices})")
    return available[0]


def default_input(mesh: MeshConfig | None, environment: str) -> Path:
    if mesh is None:
        raise UsageError("pass --input, or --config so that the environment's dataset can be found")
    datasets = mesh.instance(environment).settings.datasets
    if not datasets:
        raise UsageError(f"environment {environment} declares no datasets; pass --input")
    return datasets[0].jsonl_fpath


def head_servers(head: str) -> list[dict[str, str]]:
    """The running mesh's servers, from its head server."""
    try:
        reply = httpx.get(f"{head.rstrip('/')}/servers", timeout=10.0, trust_env=False)
        reply.raise_for_status()
        servers = reply.json()
    except (httpx.HTTPError, ValueError) as error:
        raise CollectFailed(f"cannot list the servers of {head}: {error}") from None
    return [entry for entry in servers if isinstance(entry, dict)]


def build_plan(args: argparse.Namespace, mesh: MeshConfig | None, urls: dict[str, str]) -> Plan:
    """The plan, given the config (if any) and the environment servers' URLs by name."""
    environment = pick_environment(sorted(urls), args.environment)
    source = resolve_input(args.input if args.input is not None else default_input(mesh, environment))
    return Plan(
        environment, urls[environment], read_tasks(source, args.limit), args.output,
        args.num_repeats, args.concurrency, args.rollout_timeout_s,
    )


def environment_urls(mesh: MeshConfig) -> dict[str, str]:
    return {inst.name: inst.url for inst in mesh.of_type(ENVIRONMENT_TYPE)}


# ---- collecting ----------------------------------------------------------------------------------


@dataclass
class Summary:
    """What one run did."""

    planned: int
    skipped: int
    finished: int = 0
    failed: int = 0
    elapsed_s: float = 0.0
    stopped_by: str | None = None
    metrics: dict[str, Any] = field(default_factory=dict)


@dataclass
class _Sinks:
    rows: JsonlAppender
    failures: JsonlAppender
    progress: Progress


async def _one(plan: Plan, client: MeshClient, key: RolloutKey, sinks: _Sinks, summary: Summary) -> None:
    task_index, rollout_index = key
    task = plan.tasks[task_index]
    identity = RolloutIdentity(rollout_id(task_index, rollout_index))
    try:
        reply = await client.post_json(f"{plan.environment_url}/run", json=task, identity=identity,
                                       timeout_s=plan.rollout_timeout_s)
        if not isinstance(reply, dict):
            raise UpstreamError("the environment answered something other than a row")
    except GymError as error:
        sinks.failures.append(failure_row(task, task_index, rollout_index, error.code, error.detail))
        summary.failed += 1
        sinks.progress.advance(failed=True)
        return
    sinks.rows.append(output_row(reply, task_index, rollout_index))
    summary.finished += 1
    reward = reply.get("reward")
    sinks.progress.advance(reward=float(reward) if isinstance(reward, int | float) else None)


async def collect(
    plan: Plan, client: MeshClient, keys: list[RolloutKey], sinks: _Sinks, summary: Summary
) -> None:
    """Dispatch ``keys``, at most ``plan.concurrency`` at a time, writing each result as it ends."""
    pending = deque(keys)

    async def worker() -> None:
        while pending:
            await _one(plan, client, pending.popleft(), sinks, summary)

    async with asyncio.TaskGroup() as group:
        for _ in range(min(plan.concurrency, len(pending))):
            group.create_task(worker())


async def _collect_until_stopped(
    plan: Plan, client: MeshClient, keys: list[RolloutKey], sinks: _Sinks, summary: Summary
) -> None:
    """``collect``, cancelled cleanly by SIGINT or SIGTERM (recorded in ``summary.stopped_by``)."""
    loop = asyncio.get_running_loop()
    work = asyncio.create_task(collect(plan, client, keys, sinks, summary))

    def stop(signum: int) -> None:
        summary.stopped_by = signal.Signals(signum).name
        work.cancel()

    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop, signum)
    try:
        await work
    except asyncio.CancelledError:
        if summary.stopped_by is None:
            raise
    finally:
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(signum)


async def run_plan(plan: Plan, client: MeshClient | None = None, stream: TextIO | None = None) -> Summary:
    """Collect every rollout of ``plan`` not yet in its output; answers the summary (metrics written)."""
    own_client = client is None
    client = client or MeshClient(max_connections=max(64, 2 * plan.concurrency))
    rows = JsonlAppender(plan.output)  # cuts a torn tail before the finished rows are read
    done = {key for row in read_jsonl(plan.output, complete_lines_only=True) if (key := rollout_key(row))}
    keys = [key for key in plan.rollouts() if key not in done]
    summary = Summary(planned=len(plan.rollouts()), skipped=len(plan.rollouts()) - len(keys))
    sinks = _Sinks(rows, JsonlAppender(failures_path(plan.output)), Progress(len(keys), stream))
    started = time.monotonic()
    try:
        await _collect_until_stopped(plan, client, keys, sinks, summary)
    finally:
        summary.elapsed_s = time.monotonic() - started
        sinks.progress.close()
        rows.close()
        sinks.failures.close()
        if own_client:
            await client.aclose()
    summary.metrics = _write_metrics(plan, summary)
    return summary


def _write_metrics(plan: Plan, summary: Summary) -> dict[str, Any]:
    task_fields = {key for task in plan.tasks for key in task}
    metrics = aggregate(read_jsonl(plan.output, complete_lines_only=True), task_fields, summary.failed)
    ran = summary.finished + summary.failed
    metrics.update(
        environment=plan.environment, concurrency=plan.concurrency, elapsed_s=round(summary.elapsed_s, 3),
        rollouts_per_s=round(ran / summary.elapsed_s, 3) if summary.elapsed_s > 0 else None,
    )
    metrics_path(plan.output).write_bytes(_json(metrics))
    return metrics


def _json(value: Any) -> bytes:
    return orjson.dumps(value, option=orjson.OPT_INDENT_2) + b"\n"


# ---- the command ---------------------------------------------------------------------------------


def _report(plan: Plan, summary: Summary) -> None:
    ran = summary.finished + summary.failed
    rate = f"{ran / summary.elapsed_s:.2f} rollouts/s" if summary.elapsed_s > 0 else "-"
    skipped = f", {summary.skipped} already in {plan.output}" if summary.skipped else ""
    print(f"{ran} rollouts ({summary.failed} failed) in {summary.elapsed_s:.1f} s, {rate}{skipped}")
    metrics = summary.metrics
    if metrics.get("mean_reward") is not None:
        reward, count = metrics["mean_reward"], metrics["rollouts"]
        print(f"mean reward {reward:.4f} over {count} rollouts in {plan.output}")
    for name, mean in metrics.get("means", {}).items():
        print(f"  {name}: {mean:.4g}")
    wrote = [plan.output, metrics_path(plan.output)]
    wrote += [failures_path(plan.output)] if summary.failed else []
    print("wrote " + ", ".join(str(path) for path in wrote))


def _exit_status(summary: Summary) -> int:
    if summary.stopped_by is not None:
        left = summary.planned - summary.skipped - summary.finished - summary.failed
        print(f"{PROG}: stopped by {summary.stopped_by}; {left} rollouts not run", file=sys.stderr)
        return EXIT_INTERRUPTED if summary.stopped_by == "SIGINT" else 1
    if summary.failed and not summary.finished:
        print(f"{PROG}: every rollout failed; reasons in the failures file", file=sys.stderr)
        return 1
    return 0


def _collect_and_report(plan: Plan) -> int:
    print(f"collecting {len(plan.rollouts())} rollouts of {len(plan.tasks)} tasks on {plan.environment} "
          f"({plan.environment_url}), concurrency {plan.concurrency}", file=sys.stderr)
    summary = asyncio.run(run_plan(plan))
    _report(plan, summary)
    return _exit_status(summary)


class _LogFile:
    """The launcher's line sink: every server line into one file, prefixed with its name."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.lock = threading.Lock()
        self.file = path.open("a", buffering=1)

    def __call__(self, name: str, line: str) -> None:
        with self.lock:
            self.file.write(f"[{name}] {line}\n")


def _with_launched_mesh(args: argparse.Namespace, mesh: MeshConfig) -> int:
    build_plan(args, mesh, environment_urls(mesh))  # fail on usage before starting anything
    args.output.parent.mkdir(parents=True, exist_ok=True)
    log = _LogFile(args.output.with_name(args.output.name.removesuffix(".jsonl") + "_servers.log"))
    with MeshLauncher(mesh, on_line=log) as launcher:
        with stop_on_signals(launcher):
            try:
                launcher.start(ready_timeout_s=args.ready_timeout_s)
            except StopRequested:
                print(f"{PROG}: stopped before the mesh was ready", file=sys.stderr)
                return EXIT_INTERRUPTED
            except LaunchError as error:
                print(f"{PROG}: {error} (server logs: {log.path})", file=sys.stderr)
                return 1
        print(f"mesh up, head server {launcher.head_url}; server logs in {log.path}", file=sys.stderr)
        return _collect_and_report(build_plan(args, mesh, environment_urls(launcher.mesh)))


def _with_head(args: argparse.Namespace, mesh: MeshConfig | None) -> int:
    servers = head_servers(args.head)
    urls = {entry["name"]: entry["url"] for entry in servers if entry.get("type") == ENVIRONMENT_TYPE}
    return _collect_and_report(build_plan(args, mesh, urls))


def main(args: argparse.Namespace) -> int:
    if not args.config and not args.head:
        return _usage("pass --config CONFIG (launch a mesh) or --head URL (use a running one)")
    if args.overrides and not args.config:
        return _usage("key=value overrides need --config")
    mesh = load_config(args.config, args.overrides) if args.config else None
    try:
        if args.head or mesh is None:
            return _with_head(args, mesh)
        return _with_launched_mesh(args, mesh)
    except UsageError as error:
        return _usage(str(error))
    except CollectFailed as error:
        print(f"{PROG}: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def _usage(message: str) -> int:
    print(f"{PROG}: {message}", file=sys.stderr)
    return 2
