"""``nemo-gym-ckpt collect``: rollout collection over a mesh, with checkpoints that survive preemption.

    nemo-gym-ckpt collect --config configs/quickstart.yaml --output out.jsonl
        [--input TASKS.jsonl] [--limit N] [--num-repeats K] [--concurrency C]
        [--environment NAME] [--head URL] [--checkpoint-dir DIR [--checkpoint-every-s S]]
        [key=value ...]

With ``--config`` the collector launches the mesh itself (``MeshLauncher``; server logs go to
``<output>_servers.log``) and stops it at the end; with ``--head URL`` it uses a running mesh, found
through ``GET {head}/servers``. The environment server is the config's (or the head's) only one, or
``--environment NAME``. ``--input`` defaults to the first dataset that environment declares
(relative paths are tried against the working directory, then the project root).

Each task row is dispatched ``--num-repeats`` times as ``POST {environment}/ng-rollout/<key>/run``
with rollout id ``"{task_index}-{rollout_index}"``, at most ``--concurrency`` at a time, its body
the row as NeMo Gym's collector sends it (``agent_ref``, ``_ng_task_index``, ``_ng_rollout_index``,
``_ng_attempt_index`` from attempt 1 on). Files are NeMo Gym's (``collect/rows.py``): every
dispatched row in ``<output>_materialized_inputs.jsonl`` before the first ``/run``, finished rows
appended to the output as they come, failures in ``<output>_failures.jsonl`` with NeMo Gym's
failure fields, and at the end ``<output>_aggregate_metrics.json`` in its ``AggregateMetrics``
shape. Rollouts already in the output are never run again; a run with nothing left exits 0 at once
and starts nothing. The mean reward and the mean of every numeric field the rollouts added are
printed.

Exit status: 0 only when every rollout has its row; 1 with one line naming how many failed and why
(their error codes) when some did; the finished rows are kept and a run with the same arguments
dispatches the rest. With a launched mesh, a server process that exits during the collection stops
it: the mesh is stopped and the line names the server and its exit status (exit 1).

With ``--checkpoint-dir DIR`` the collector is the mesh's checkpoint controller
(``collection_control``; files: ``collection_checkpoint``). A mesh it launches gets
``checkpoint.enabled=true``, ``checkpoint.root=DIR`` and a fresh control token, unless the config
enables checkpointing itself (then DIR must lie inside its root); with ``--head`` the token is
``--token`` or ``$GYM_CKPT_TOKEN``. Checkpoints are taken every ``--checkpoint-every-s`` seconds, on
SIGUSR1 (and the collection goes on), and on SIGTERM (then the collector stops and exits 75). Run
again with the same arguments: the latest published checkpoint is restored on the fresh mesh, every
other attempt dispatched before is fenced, and each unfinished rollout goes on (as its next attempt)
or starts over. Output rows carry ``_ng_attempt_index``.

Ctrl-C stops dispatching, cancels the rollouts in flight, keeps every row already written, stops
the mesh it launched and exits 130; SIGTERM without ``--checkpoint-dir`` does the same with exit 1.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import os
import secrets
import sys
import threading
from collections.abc import Mapping
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import httpx

from nemo_gym_ckpt.checkpoint.coordinator import CONFIG_ROUTE, Coordinator, global_config_of
from nemo_gym_ckpt.checkpoint.otlp import install_telemetry
from nemo_gym_ckpt.cli.arguments import head_url, seconds
from nemo_gym_ckpt.cli.exit_codes import ExitCode, exit_code_for
from nemo_gym_ckpt.cli.run import stop_on_signals
from nemo_gym_ckpt.collect.control import CollectionControl, ControlSettings
from nemo_gym_ckpt.collect.dispatch import CollectionStartFailed, Plan, Summary, Watch, done_keys, run_plan
from nemo_gym_ckpt.collect.published import (
    RunIdentity,
    check_same_run,
    config_digest,
    find_latest,
    input_digest,
    read_dispatched,
)
from nemo_gym_ckpt.collect.rows import failures_path, materialized_path, metrics_path
from nemo_gym_ckpt.collect.tasks import default_input, read_tasks, resolve_input
from nemo_gym_ckpt.collect.triggers import Triggers, hold_signals
from nemo_gym_ckpt.config import (
    TOKEN_ENV,
    MeshConfig,
    ServerConfig,
    ServerRef,
    load_config,
)
from nemo_gym_ckpt.config_overrides import quote_override_value
from nemo_gym_ckpt.errors import CollectFailed, UpstreamError, UsageError
from nemo_gym_ckpt.launch.launcher import LaunchError, MeshLauncher, StopRequested

__all__ = [
    "TOKEN_ENV",
    "CheckpointSetup",
    "Plan",
    "Summary",
    "configure",
    "main",
    "run_plan",
]

PROG = "nemo-gym-ckpt collect"
ENVIRONMENT_TYPE: Literal["environment_servers"] = "environment_servers"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.description = "Collect rollouts: one /run per task row and repeat, rows appended to --output."
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, as for run")
    parser.add_argument("--config", action="append", default=[], metavar="CONFIG",
                        help="mesh YAML to launch (repeat to merge several)")
    parser.add_argument("--head", type=head_url, metavar="URL",
                        help="use the running mesh of this head server instead")
    parser.add_argument("--input", type=Path, help="task rows (default: the environment's first dataset)")
    parser.add_argument("--output", type=Path, required=True, help="rollout rows are appended here")
    parser.add_argument("--environment", help="the environment server to use, if the mesh has several")
    parser.add_argument("--limit", type=_positive, help="use only the first N task rows")
    parser.add_argument("--num-repeats", type=_positive, default=1, help="rollouts per task row (default 1)")
    parser.add_argument("--concurrency", type=_positive, default=8, help="rollouts in flight (default 8)")
    parser.add_argument("--rollout-timeout-s", type=seconds, default=3600.0, help="deadline of one rollout")
    parser.add_argument("--ready-timeout-s", type=seconds, default=300.0, help="deadline for the mesh to start")
    group = parser.add_argument_group("checkpointing")
    group.add_argument("--checkpoint-dir", type=Path, metavar="DIR",
                       help="checkpoint the mesh into DIR (SIGUSR1: checkpoint; SIGTERM: checkpoint, "
                            "exit 75); run again with the same arguments to restore and continue")
    group.add_argument("--checkpoint-every-s", type=seconds, metavar="S", help="also every S seconds")
    group.add_argument("--checkpoint-timeout-s", type=seconds, default=300.0,
                       help="deadline of one checkpoint and of the restore (default 300)")
    group.add_argument("--token", help=f"control token of a --head mesh (default: ${TOKEN_ENV}; the "
                                       "environment keeps it out of the process list)")


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


# ---- the plan ------------------------------------------------------------------------------------


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


def head_servers(head: str) -> list[dict[str, str]]:
    """The running mesh's servers, from its head server."""
    try:
        reply = httpx.get(f"{head.rstrip('/')}/servers", timeout=10.0, trust_env=False)
        reply.raise_for_status()
        servers = reply.json()
    except (httpx.HTTPError, ValueError) as error:
        raise CollectFailed(f"cannot list the servers of {head}: {error}") from None
    return [entry for entry in servers if isinstance(entry, dict)]


def head_agent_refs(head: str) -> dict[str, dict[str, str]]:
    """The agent each environment server of a running mesh fronts, read from its head's NeMo Gym config
    route as NeMo Gym's collector reads it."""
    try:
        reply = httpx.get(f"{head.rstrip('/')}{CONFIG_ROUTE}", timeout=10.0, trust_env=False)
        reply.raise_for_status()
        config = global_config_of(reply.content)
    except (httpx.HTTPError, UpstreamError) as error:
        raise CollectFailed(f"cannot read the config of {head}: {error}") from None
    return agent_refs_in_config(config)


def agent_refs_in_config(config: Any) -> dict[str, dict[str, str]]:
    """``{environment server: {type, name} of its agent_server}`` of a global config in NeMo Gym's shape."""
    refs = {}
    for name, block in (config.items() if isinstance(config, Mapping) else ()):
        implementations = block.get(ENVIRONMENT_TYPE) if isinstance(block, Mapping) else None
        settings = next(iter(implementations.values()), None) if isinstance(implementations, Mapping) else None
        ref = settings.get("agent_server") if isinstance(settings, Mapping) else None
        if isinstance(ref, Mapping) and isinstance(ref.get("type"), str) and isinstance(ref.get("name"), str):
            refs[str(name)] = {"type": ref["type"], "name": ref["name"]}
    return refs


@dataclass(frozen=True)
class EnvironmentServer:
    """What the collector knows of one environment server: where it is and what its rows are stamped with."""

    url: str
    implementation: str | None = None
    agent_ref: dict[str, str] | None = None


def build_plan(args: argparse.Namespace, mesh: MeshConfig | None, servers: dict[str, EnvironmentServer]) -> Plan:
    """The plan, given the config (if any) and the environment servers by name."""
    environment = pick_environment(sorted(servers), args.environment)
    server = servers[environment]
    source = resolve_input(args.input if args.input is not None else default_input(mesh, environment))
    return Plan(
        environment, server.url, read_tasks(source, args.limit), args.output,
        args.num_repeats, args.concurrency, args.rollout_timeout_s, server.implementation, server.agent_ref,
    )


def agent_ref_of(settings: ServerConfig) -> dict[str, str] | None:
    """The ``{type, name}`` of the agent an environment server's settings name, if they name one."""
    ref = getattr(settings, "agent_server", None)
    return {"type": ref.type, "name": ref.name} if isinstance(ref, ServerRef) else None


def environment_servers(mesh: MeshConfig) -> dict[str, EnvironmentServer]:
    return {inst.name: EnvironmentServer(inst.url, inst.implementation, agent_ref_of(inst.settings))
            for inst in mesh.of_type(ENVIRONMENT_TYPE)}


def nothing_left(plan: Plan) -> bool:
    """Every rollout of the plan has its row in the output already."""
    return not set(plan.rollouts()) - done_keys(plan.output)


# ---- checkpointing -------------------------------------------------------------------------------


@dataclass(frozen=True)
class CheckpointSetup:
    """How this run checkpoints its mesh: where, with which token, how often."""

    directory: Path
    token: str
    identity: RunIdentity
    every_s: float | None = None
    timeout_s: float = 300.0
    max_record_bytes: int | None = None
    """The mesh's ``checkpoint.max_record_bytes``; ``None`` when it is not known (``--head`` without
    ``--config``): the files are then not read before a restore (a bound lower than the mesh's would
    refuse a checkpoint its participants can restore)."""

    def check_latest(self) -> None:
        """``CheckpointRefused`` if the directory's latest checkpoint belongs to another collection,
        or its files (``LATEST``, ``collection.json``, the dispatch log) are damaged."""
        latest = find_latest(self.directory)
        if latest is not None:
            check_same_run(latest, self.identity, self.directory)
        read_dispatched(self.directory)

    def triggers(self) -> Triggers:
        return Triggers(self.every_s)

    def control(self, head_url: str) -> CollectionControl:
        coordinator = Coordinator(head_url, self.token, required_kinds=("model",))
        settings = ControlSettings(self.directory, self.identity, self.timeout_s,
                                   max_record_bytes=self.max_record_bytes)
        return CollectionControl(coordinator, settings)


def run_identity(raw: Any, plan: Plan) -> RunIdentity:
    return RunIdentity(config_digest(raw), input_digest(plan.tasks), plan.num_repeats)


def checkpoint_overrides(mesh: MeshConfig, directory: Path) -> list[str]:
    """What a launched mesh needs to checkpoint into ``directory`` (nothing when its config does)."""
    block = mesh.checkpoint
    if block.enabled:
        if block.root is None:  # no root: any absolute directory is accepted
            return []
        root = block.root.absolute().resolve()
        if not directory.resolve().is_relative_to(root) or directory.resolve() == root:
            raise UsageError(f"--checkpoint-dir {directory} is not inside the config's "
                             f"checkpoint.root {root}")
        return []
    overrides = ["checkpoint.enabled=true", f"checkpoint.root={quote_override_value(str(directory))}"]
    token = block.control_auth_token
    if token is None or not token.get_secret_value():
        overrides.append(f"checkpoint.control_auth_token=ng-{secrets.token_hex(16)}")
    return overrides


def _token_of(mesh: MeshConfig) -> str:
    token = mesh.checkpoint.control_auth_token
    assert token is not None  # enabled checkpointing requires one (config validation)
    return token.get_secret_value()


def _head_token(args: argparse.Namespace) -> str:
    token = args.token or os.environ.get(TOKEN_ENV, "")
    if not token:
        raise UsageError(f"--checkpoint-dir with --head needs the mesh's control token: set {TOKEN_ENV} "
                         "(or pass --token)")
    return token


# ---- the command ---------------------------------------------------------------------------------


def _report(plan: Plan, summary: Summary) -> None:
    ran = summary.finished + summary.failed
    rate = f"{ran / summary.elapsed_s:.2f} rollouts/s" if summary.elapsed_s > 0 else "-"
    skipped = f", {summary.skipped} already in {plan.output}" if summary.skipped else ""
    continued = f", {summary.continued} continued from a checkpoint" if summary.continued else ""
    elapsed = f"{summary.elapsed_s:.1f} s"
    print(f"{ran} rollouts ({summary.failed} failed) in {elapsed}, {rate}{skipped}{continued}")
    for published in summary.checkpoints:
        manifest = published.manifest
        print(f"checkpoint {manifest.checkpoint_id}: {len(manifest.continued)} rollouts in flight kept, "
              f"{len(manifest.restarted)} to start over, paused {published.pause_ms:.0f} ms")
    metrics = summary.metrics
    if metrics.get("mean_reward") is not None:
        reward, count = metrics["mean_reward"], metrics["rollouts"]
        print(f"mean reward {reward:.4f} over {count} rollouts in {plan.output}")
    for name, mean in metrics.get("means", {}).items():
        print(f"  {name}: {mean:.4g}")
    wrote = [plan.output, materialized_path(plan.output), metrics_path(plan.output)]
    wrote += [failures_path(plan.output)] if summary.failed else []
    print("wrote " + ", ".join(str(path) for path in wrote))


def _exit_status(plan: Plan, summary: Summary) -> ExitCode:
    """0 only when every rollout of the plan has its row; else 1 (or 75, 130) with one line saying why."""
    left = summary.planned - summary.skipped - summary.finished - summary.failed
    rerun = "run again with the same arguments to continue"
    if summary.stopped_by in ("SIGTERM", "SIGINT"):
        if summary.stopped_by == "SIGTERM" and summary.stop_checkpointed:
            print(f"{PROG}: checkpointed and stopped by SIGTERM; {left} rollouts left: {rerun}", file=sys.stderr)
            return ExitCode.CHECKPOINTED
        print(f"{PROG}: stopped by {summary.stopped_by}; {left} rollouts not run", file=sys.stderr)
        return ExitCode.INTERRUPTED if summary.stopped_by == "SIGINT" else ExitCode.FAILURE
    if summary.stopped_by is not None:  # a server of the mesh exited
        failed = f", {_failures_line(summary)}" if summary.failed else ""
        print(f"{PROG}: {summary.stopped_by} during the collection: stopped the mesh; {left} rollouts not run"
              f"{failed}; the {summary.finished} finished ones are kept in {plan.output}: {rerun}", file=sys.stderr)
        return ExitCode.FAILURE
    if summary.failed:
        print(f"{PROG}: {_failures_line(summary)}; the {summary.finished} finished ones are kept in {plan.output}: "
              f"run again with the same arguments to retry the failed ones (reasons in "
              f"{failures_path(plan.output)})", file=sys.stderr)
        return ExitCode.FAILURE
    return ExitCode.OK


def _failures_line(summary: Summary) -> str:
    ran = summary.finished + summary.failed
    codes = ", ".join(f"{count} {code}" for code, count in summary.failure_codes.most_common())
    return f"{summary.failed} of {ran} rollouts failed ({codes})"


async def _collect(
    plan: Plan, head_url: str | None, checkpoint: CheckpointSetup | None, triggers: Triggers | None,
    watch: Watch | None,
) -> Summary:
    if checkpoint is None or head_url is None:
        return await run_plan(plan, watch=watch)
    control = checkpoint.control(head_url)
    try:
        return await run_plan(plan, control=control, triggers=triggers or checkpoint.triggers(), watch=watch)
    finally:
        control.close()
        await control.coordinator.aclose()


def _collect_and_report(
    plan: Plan, head_url: str | None = None, checkpoint: CheckpointSetup | None = None,
    triggers: Triggers | None = None, watch: Watch | None = None,
) -> ExitCode:
    print(f"collecting {len(plan.rollouts())} rollouts of {len(plan.tasks)} tasks on {plan.environment} "
          f"({plan.environment_url}), concurrency {plan.concurrency}", file=sys.stderr)
    try:
        summary = asyncio.run(_collect(plan, head_url, checkpoint, triggers, watch))
    except CollectionStartFailed as error:
        raise CollectFailed(f"cannot restore and fence before dispatching: {error}") from None
    _report(plan, summary)
    return _exit_status(plan, summary)


class _LogFile:
    """The launcher's line sink: every server line into one file, prefixed with its name. Opened
    without blocking: a FIFO there with a reader is written to, one without is refused (it would
    block the open for ever)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.lock = threading.Lock()
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
        except OSError as error:
            reader = " (a FIFO that no process reads)" if error.errno == errno.ENXIO else ""
            raise UsageError(f"cannot open the server log {path}: {error.strerror or error}{reader}") from None
        os.set_blocking(fd, True)
        self.file = os.fdopen(fd, "a", buffering=1)

    def __call__(self, name: str, line: str) -> None:
        with self.lock:
            self.file.write(f"[{name}] {line}\n")


def _nothing_left(plan: Plan) -> ExitCode:
    print(f"nothing left: all {len(plan.rollouts())} rollouts are in {plan.output}")
    return ExitCode.OK


def _launch_setup(args: argparse.Namespace, mesh: MeshConfig) -> tuple[MeshConfig, CheckpointSetup | None]:
    """The config to launch (with checkpoint overrides) and the checkpoint setup, if asked for."""
    if args.checkpoint_dir is None:
        return mesh, None
    directory = args.checkpoint_dir.absolute()
    mesh = load_config(args.config, [*args.overrides, *checkpoint_overrides(mesh, directory)])
    plan = build_plan(args, mesh, environment_servers(mesh))
    setup = CheckpointSetup(directory, _token_of(mesh), run_identity(mesh.raw, plan),
                            args.checkpoint_every_s, args.checkpoint_timeout_s, mesh.checkpoint.max_record_bytes)
    return mesh, setup


def _with_launched_mesh(args: argparse.Namespace, mesh: MeshConfig) -> ExitCode:
    plan = build_plan(args, mesh, environment_servers(mesh))  # fail on usage before starting anything
    mesh, checkpoint = _launch_setup(args, mesh)
    if checkpoint is not None:
        checkpoint.check_latest()
    if nothing_left(plan):
        return _nothing_left(plan)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    log = _LogFile(args.output.with_name(args.output.name.removesuffix(".jsonl") + "_servers.log"))
    triggers = checkpoint.triggers() if checkpoint is not None else None
    with MeshLauncher(mesh, on_line=log) as launcher:
        status = _start(launcher, args.ready_timeout_s, log.path, triggers)
        if status is not None:
            return status
        print(f"mesh up, head server {launcher.head_url}; server logs in {log.path}", file=sys.stderr)
        plan = build_plan(args, mesh, environment_servers(launcher.mesh))
        return _collect_and_report(plan, launcher.head_url, checkpoint, triggers, launcher.exited)


def _start(
    launcher: MeshLauncher, ready_timeout_s: float, log: Path, triggers: Triggers | None
) -> ExitCode | None:
    """Start the mesh; None when it is up, else the exit status (SIGUSR1 meanwhile is kept for later)."""
    with stop_on_signals(launcher) as stopped_by, hold_signals(triggers) if triggers else nullcontext():
        try:
            launcher.start(ready_timeout_s=ready_timeout_s)
        except StopRequested:
            print(f"{PROG}: stopped by {stopped_by[0]} before the mesh was ready", file=sys.stderr)
            checkpointing = triggers is not None and stopped_by[0] == "SIGTERM"
            return ExitCode.CHECKPOINTED if checkpointing else ExitCode.INTERRUPTED
        except LaunchError as error:
            print(f"{PROG}: {error} (server logs: {log})", file=sys.stderr)
            return exit_code_for(error)
    return None


def _with_head(args: argparse.Namespace, mesh: MeshConfig | None) -> ExitCode:
    servers = head_servers(args.head)
    agents = head_agent_refs(args.head)
    environments = {
        entry["name"]: EnvironmentServer(entry["url"], entry.get("implementation"), agents.get(entry["name"]))
        for entry in servers if entry.get("type") == ENVIRONMENT_TYPE
    }
    plan = build_plan(args, mesh, environments)
    checkpoint = None
    if args.checkpoint_dir is not None:
        listing = [{k: v for k, v in entry.items() if k != "url"} for entry in servers]
        raw = mesh.raw if mesh is not None else {"servers": listing}
        bound = mesh.checkpoint.max_record_bytes if mesh is not None else None
        checkpoint = CheckpointSetup(args.checkpoint_dir.absolute(), _head_token(args),
                                     run_identity(raw, plan), args.checkpoint_every_s,
                                     args.checkpoint_timeout_s, bound)
        checkpoint.check_latest()
    if nothing_left(plan):
        return _nothing_left(plan)
    return _collect_and_report(plan, args.head, checkpoint)


def _check_flags(args: argparse.Namespace) -> None:
    if not args.config and not args.head:
        raise UsageError("pass --config CONFIG (launch a mesh) or --head URL (use a running one)")
    if args.overrides and not args.config:
        raise UsageError("key=value overrides need --config")
    if args.checkpoint_dir is None and (args.checkpoint_every_s is not None or args.token):
        raise UsageError("--checkpoint-every-s and --token need --checkpoint-dir")


def _with_mesh_or_head(args: argparse.Namespace, mesh: MeshConfig | None) -> ExitCode:
    if args.head or mesh is None:
        return _with_head(args, mesh)
    return _with_launched_mesh(args, mesh)


def main(args: argparse.Namespace) -> ExitCode:
    try:
        _check_flags(args)
        mesh = load_config(args.config, args.overrides) if args.config else None
        exporting = install_telemetry(mesh.telemetry, "collector") if mesh is not None else None
        try:
            return _with_mesh_or_head(args, mesh)
        finally:
            if exporting is not None:  # the final flush, bounded: a hung OTLP endpoint never holds the exit
                exporting.shutdown()
    except (UsageError, CollectFailed) as error:
        print(f"{PROG}: {error}", file=sys.stderr)
        return exit_code_for(error)
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return ExitCode.INTERRUPTED
