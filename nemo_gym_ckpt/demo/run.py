"""The demo: checkpoint the quickstart mesh mid-collection, kill it, restore, compare.

    nemo-gym-ckpt demo [--json PATH] [--rollouts N] [--concurrency C] [--workdir DIR] [--no-generation-cuts]

On the quickstart mesh (``configs/quickstart.yaml``: the embedded model on the CPU, greedy), with
checkpointing on and, unless ``--no-generation-cuts``, ``generation_cuts: true`` on the policy model
(an override the demo applies; the config file is left as it is):

1. **reference**: the mesh (checkpointing on, never used) collects the first N task rows,
   uninterrupted;
2. **interrupted**: the same mesh collects the same rows again with the collector as controller
   (``collection_control``); once a quarter of the rows are written and the rollouts in flight are
   in the middle of their episodes, it takes a checkpoint, and right after publishing it (before
   resuming anyone) every server process gets SIGKILL. With cuts on, the checkpoint is asked for
   at a moment when several model calls are generating on the worker (its cut status lists them
   with their tokens so far), so that the commit cuts them mid-generation;
3. **restored**: fresh processes on the same ports; the collector, run again on the same directory,
   restores the checkpoint, continues the checkpointed rollouts as their next attempt, dispatches the
   rest, and finishes.

Then it prints the two runs side by side and, with ``--json``, writes the numbers: ``rollouts``,
``identical_to_reference`` (every row equal to the reference's but timestamps and attempt index,
logprobs within 1e-4), ``restored_episodes``, ``continued_model_calls_skipped`` (model calls the
continued rollouts did not make again: the capture-ledger rows of the checkpoint), ``cut_calls``,
``tokens_kept`` (tokens the restored worker served from staged prefixes instead of generating),
``tokens_regenerated`` (tokens of cut calls produced before the checkpoint and generated again:
0 when every cut was continued), ``tokens_regenerated_uncut`` (output tokens of the calls in flight
at the checkpoint that were not cut and were generated again; see ``demo_metrics``),
``checkpoint_pause_ms`` (first prepare until published), ``restore_ms`` (restore, fencing and
resume), ``checkpoint_bytes``.
Exit status 0 only when the restored run is identical to the reference.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import logging
import secrets
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nemo_gym_ckpt.checkpoint.coordinator import Coordinator
from nemo_gym_ckpt.client import MeshClient
from nemo_gym_ckpt.collect.control import CollectionControl, ControlSettings, Published
from nemo_gym_ckpt.collect.dispatch import HeldBack, Plan, Summary, run_plan
from nemo_gym_ckpt.collect.published import CollectionManifest, RunIdentity, config_digest, input_digest
from nemo_gym_ckpt.collect.rows import RowComparison, compare_rows, read_jsonl
from nemo_gym_ckpt.collect.triggers import Triggers
from nemo_gym_ckpt.config import PROJECT_ROOT, MeshConfig, ServerInstance, load_config
from nemo_gym_ckpt.config_overrides import quote_override_value
from nemo_gym_ckpt.demo.metrics import CrashState, checkpoint_metrics
from nemo_gym_ckpt.errors import GymError, MeshCrashed
from nemo_gym_ckpt.launch.launcher import MeshLauncher

__all__ = ["CUT_TRIES", "DEFAULT_CONFIG", "DemoResult", "again_for_a_cut", "proof_table", "run_demo"]

logger = logging.getLogger(__name__)

DEFAULT_CONFIG = PROJECT_ROOT / "configs" / "quickstart.yaml"
ENVIRONMENT = "single_agent_turn"
HELD_WAIT_S = 10.0
PHASE_TIMEOUT_S = 300.0
CUT_STATUS = "/ng-control/v1/generation-cut/status"
STATUS_TIMEOUT_S = 10.0
CUT_MIN_TOKENS = 2  # a generation counts as "mid-generation" once it produced this many tokens
CUT_TRIES = 3
"""With cuts on, at most this many checkpoints are taken for the crash. After one that caught no
call mid-generation (every call it saw generating had finished by the time the worker held it, as
on a loaded machine), published like any other, the mesh resumes and another is asked for, while
some rollout is still to start (the run then lasts at least one more rollout)."""


# ---- the runs ------------------------------------------------------------------------------------


@dataclass
class DemoResult:
    """Everything the demo measured."""

    rollouts: int
    reference: Summary
    restored: Summary
    comparison: RowComparison
    checkpoint: Published
    crash: CrashState
    control: CollectionControl
    cut_status: dict[str, Any] | None
    """The worker's generation-cut status after the restored run (``None`` with cuts off)."""
    metrics: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)


@contextmanager
def _timed(timings: dict[str, float], name: str) -> Iterator[None]:
    started = time.monotonic()
    try:
        yield
    finally:
        timings[name] = round(time.monotonic() - started, 2)


def _quiet(name: str, line: str) -> None:
    logger.debug("[%s] %s", name, line)


def _tasks(mesh: MeshConfig, count: int) -> list[dict[str, Any]]:
    dataset = mesh.instance(ENVIRONMENT).settings.datasets[0].jsonl_fpath
    path = dataset if dataset.is_absolute() else PROJECT_ROOT / dataset
    tasks = list(read_jsonl(path))[:count]
    if len(tasks) < count:
        raise ValueError(f"{path} holds {len(tasks)} task rows, fewer than {count}")
    return tasks


def _start(mesh: MeshConfig, ready_timeout_s: float) -> MeshLauncher:
    launcher = MeshLauncher(mesh, on_line=_quiet)
    launcher.start(ready_timeout_s=ready_timeout_s)
    return launcher


@dataclass
class _DemoMesh:
    """The quickstart mesh with checkpointing on, and the collector runs the demo makes on it."""

    launcher: MeshLauncher
    root: Path
    token: str
    identity: RunIdentity
    tasks: list[dict[str, Any]]
    concurrency: int
    worker_url: str | None = None
    """The policy's inference worker when generation cuts are on (its cut status is polled)."""
    crash: CrashState = field(default_factory=CrashState)
    _crashing: CollectionControl | None = None
    _output: Path = Path()
    _uncut: asyncio.Event = field(default_factory=asyncio.Event)
    """Set when a checkpoint caught no cut and the crash waits for another one."""

    def plan(self, output: Path) -> Plan:
        url = self.launcher.url_of(ENVIRONMENT)
        return Plan(ENVIRONMENT, url, self.tasks, output, 1, self.concurrency, PHASE_TIMEOUT_S)

    def control(self, directory: str, *, crash: bool = False) -> CollectionControl:
        coordinator = Coordinator(self.launcher.head_url, self.token, required_kinds=("model",))
        settings = ControlSettings(self.root / directory, self.identity, timeout_s=60.0)
        return CollectionControl(coordinator, settings, after_publish=self._crash if crash else None)

    async def collect(self, output: Path, control: CollectionControl, triggers: Triggers | None = None,
                      held_back: HeldBack | None = None) -> Summary:
        """One collector run as the mesh's controller (it forgets every rollout it finished)."""
        try:
            return await run_plan(self.plan(output), stream=io.StringIO(), control=control, triggers=triggers,
                                  held_back=held_back)
        finally:
            control.close()
            await control.coordinator.aclose()

    async def until_crash(self, output: Path) -> None:
        """Collect until a checkpoint mid-collection is published, then SIGKILL every server."""
        self._crashing, self._output = self.control("collection", crash=True), output
        control = self._crashing
        triggers = Triggers()
        # The last batch is held until the checkpoint is about to be asked for: then the collection
        # cannot end before the checkpoint, however slow the machine.
        held_back = HeldBack(min(self.concurrency, len(self.tasks) // 2), asyncio.Event())
        watcher = asyncio.create_task(self._request_midway(triggers, control.coordinator, output, held_back))
        try:
            await self.collect(output, control, triggers, held_back)
        except MeshCrashed:
            return
        finally:
            watcher.cancel()
        raise RuntimeError("the collection ended before the checkpoint; use more --rollouts")

    async def _request_midway(
        self, triggers: Triggers, coordinator: Coordinator, output: Path, held_back: HeldBack
    ) -> None:
        """Ask for a checkpoint once a quarter of the rows are written and then half a batch more
        model calls were delivered (the rollouts in flight stand in the middle of their episodes);
        with cuts on, also not before half a batch of calls are generating on the worker."""
        rows, calls = len(self.tasks) // 4, max(1, self.concurrency // 2)
        await _until_midway(coordinator, output, rows, calls)
        held_back.release.set()  # fresh rollouts start now: the run lasts at least one more rollout
        while True:
            if self.worker_url is not None:
                await _until_generating(coordinator, self.worker_url, self.token, calls)
            triggers.request("demo")
            await self._uncut.wait()  # cancelled at the crash
            self._uncut.clear()

    async def cut_status(self) -> dict[str, Any] | None:
        """The worker's generation-cut status (``None`` with cuts off; empty if it cannot be read)."""
        if self.worker_url is None:
            return None
        async with MeshClient() as client:
            try:
                return await _cut_status(client, self.worker_url, self.token)
            except GymError as error:
                logger.warning("cannot read the worker's cut status: %s", error.detail)
                return {}

    async def _crash(self, published: Published) -> None:
        """Wait until every call in flight has its full answer held, note it, then SIGKILL everyone."""
        assert self._crashing is not None
        if self.worker_url is not None and again_for_a_cut(published.manifest, self.crash.uncut_checkpoints,
                                                           len(self.tasks)):
            self.crash.uncut_checkpoints += 1
            logger.warning("checkpoint %s caught no call mid-generation; the mesh resumes and another "
                           "is taken", published.manifest.checkpoint_id)
            self._uncut.set()
            return
        self.crash.published = published
        try:
            self.crash.model = await _model_extras(self._crashing.coordinator, settled=True)
        except GymError as error:
            logger.warning("cannot read the model's status before the crash: %s", error.detail)
        self.crash.rows_written = len(list(read_jsonl(self._output, complete_lines_only=True)))
        self.crash.killed = self.launcher.kill_all(signal.SIGKILL)  # blocking: nothing else runs meanwhile
        raise MeshCrashed(published.manifest.checkpoint_id)


def again_for_a_cut(manifest: CollectionManifest, uncut_before: int, tasks: int) -> bool:
    """Whether the demo (cuts on) resumes and takes another checkpoint instead of crashing after the
    one ``manifest`` describes: it kept no cut, ``uncut_before`` such checkpoints came before it and
    tries are left (``CUT_TRIES``), and some of the ``tasks`` rollouts is still to start."""
    if any(manifest.staging_keys.values()) or uncut_before + 1 >= CUT_TRIES:
        return False
    return manifest.rows_done + len(manifest.continued) + len(manifest.restarted) < tasks


async def _model_extras(coordinator: Coordinator, *, settled: bool = False) -> dict[str, Any]:
    """The model participant's status extras; ``settled``: once no admitted call still generates."""
    deadline = time.monotonic() + HELD_WAIT_S
    while True:
        statuses = await coordinator.status()
        extras = next(status for status in statuses.values() if status["kind"] == "model")["extras"]
        finished = extras.get("held_responses", 0) + extras.get("delivering_streams", 0)
        generating = extras.get("active_calls", 0) - finished
        if not settled or generating <= 0 or time.monotonic() > deadline:
            return dict(extras)
        await asyncio.sleep(0.02)


async def _until_midway(coordinator: Coordinator, output: Path, rows: int, calls: int) -> None:
    """Until ``rows`` rows are written and then ``calls`` more model calls were delivered (polling;
    the second wait is bounded, the run bounds the first)."""
    while len(list(read_jsonl(output, complete_lines_only=True))) < rows:
        await asyncio.sleep(0.02)
    deadline = time.monotonic() + HELD_WAIT_S
    try:
        delivered = (await _model_extras(coordinator)).get("rows", 0)
        while (await _model_extras(coordinator)).get("rows", 0) < delivered + calls:
            if time.monotonic() > deadline:
                break
            await asyncio.sleep(0.02)
    except GymError as error:
        logger.warning("cannot read the model's status (%s); checkpointing now", error.detail)


async def _cut_status(client: MeshClient, worker_url: str, token: str) -> dict[str, Any]:
    status: dict[str, Any] = await client.get_json(
        worker_url + CUT_STATUS, headers={"authorization": f"Bearer {token}"}, rollout_prefix=False,
        timeout_s=STATUS_TIMEOUT_S)
    return status


async def _until_generating(coordinator: Coordinator, worker_url: str, token: str, count: int) -> None:
    """Until ``count`` calls are generating on the worker, each past ``CUT_MIN_TOKENS`` tokens and
    not finished (polling; bounded: at the deadline the checkpoint is asked for anyway)."""
    deadline = time.monotonic() + HELD_WAIT_S
    try:
        while time.monotonic() < deadline:
            generations = (await _cut_status(coordinator.client, worker_url, token))["live_generations"]
            running = [g for g in generations if g["model_call_id"] and not g["finished"]
                       and g["tokens"] >= CUT_MIN_TOKENS]
            if len(running) >= count:
                return
            await asyncio.sleep(0.002)
        logger.warning("fewer than %d calls were generating at once; checkpointing now", count)
    except GymError as error:
        logger.warning("cannot read the worker's cut status (%s); checkpointing now", error.detail)


def _launch(args: argparse.Namespace, workdir: Path, timings: dict[str, float]) -> _DemoMesh:
    root = (workdir / "checkpoints").absolute()
    token = f"demo-{secrets.token_hex(16)}"
    overrides = ["head_server.port=0", "checkpoint.enabled=true", f"checkpoint.root={quote_override_value(str(root))}",
                 f"checkpoint.control_auth_token={token}"]
    mesh = load_config([args.config], overrides)
    policy = _policy_on_worker(mesh)
    if args.generation_cuts and policy is not None:
        mesh = load_config([args.config], [*overrides, _setting(policy, "generation_cuts", "true")])
    tasks = _tasks(mesh, args.rollouts)
    identity = RunIdentity(config_digest(mesh.raw), input_digest(tasks), 1)
    with _timed(timings, "mesh_start_s"):
        launcher = _start(mesh, args.ready_timeout_s)
    worker = getattr(policy.settings, "worker", None) if policy is not None and args.generation_cuts else None
    worker_url = launcher.url_of(worker.name) if worker is not None else None
    return _DemoMesh(launcher, root, token, identity, tasks, args.concurrency, worker_url)


def _policy_on_worker(mesh: MeshConfig) -> ServerInstance | None:
    """The policy participant (``checkpoint_policy: true``) if it generates on our inference worker."""
    return next((instance for instance in mesh.instances.values()
                 if getattr(instance.settings, "checkpoint_policy", False)
                 and getattr(instance.settings, "worker", None) is not None), None)


def _setting(instance: ServerInstance, key: str, value: str) -> str:
    """The ``key=value`` override of one setting of ``instance``."""
    return f"{instance.name}.{instance.type}.{instance.implementation}.{key}={value}"


# ---- the command ---------------------------------------------------------------------------------


def run_demo(args: argparse.Namespace, workdir: Path) -> DemoResult:
    """The reference run, the interrupted one and its restore, on one mesh (started once, killed once)."""
    timings: dict[str, float] = {}
    reference_rows, rows = workdir / "reference.jsonl", workdir / "rollouts.jsonl"
    with _timed(timings, "wall_s"):
        demo = _launch(args, workdir, timings)
        with demo.launcher:
            with _timed(timings, "reference_collect_s"):
                reference = asyncio.run(demo.collect(reference_rows, demo.control("reference")))
            with _timed(timings, "interrupted_collect_s"):
                asyncio.run(demo.until_crash(rows))
            with _timed(timings, "restart_s"):
                demo.launcher.restart(*demo.launcher.names, ready_timeout_s=args.ready_timeout_s)
            control = demo.control("collection")
            with _timed(timings, "restored_collect_s"):
                restored = asyncio.run(demo.collect(rows, control))
            cut_status = asyncio.run(demo.cut_status())  # the restarted worker's: the restored run's counts
    assert demo.crash.published is not None
    comparison = compare_rows(read_jsonl(reference_rows), read_jsonl(rows))
    result = DemoResult(len(demo.tasks), reference, restored, comparison, demo.crash.published, demo.crash,
                        control, cut_status, timings=timings)
    result.metrics = _metrics(result, demo.root / "collection", rows)
    return result


def _metrics(result: DemoResult, directory: Path, rows: Path) -> dict[str, Any]:
    differing = result.comparison.differing + result.comparison.missing
    checkpoint = checkpoint_metrics(directory / result.checkpoint.manifest.checkpoint_id,
                                    result.control.restored, result.crash, rows, result.cut_status)
    return {
        "rollouts": result.rollouts,
        "identical_to_reference": result.comparison.identical,
        "differing_rollouts": [f"{t}-{r}" for t, r in differing],
        "max_logprob_diff": result.comparison.max_logprob_diff,
        "token_arrays_compared": result.comparison.token_arrays_compared,
        "token_arrays_not_restored": result.comparison.token_arrays_absent,
        **checkpoint,
        "checkpoint_id": result.checkpoint.manifest.checkpoint_id,
        "checkpoint_pause_ms": result.checkpoint.published_ms,
        "restore_ms": result.control.restored.restore_ms,
        "checkpoint_bytes": result.checkpoint.manifest.stats.get("bytes", 0),
        "rows_before_crash": result.crash.rows_written,
        "servers_killed": result.crash.killed,
        "mean_reward_reference": result.reference.metrics.get("mean_reward"),
        "mean_reward_restored": result.restored.metrics.get("mean_reward"),
        "timings_s": result.timings,
    }


def proof_table(metrics: dict[str, Any]) -> str:
    t = metrics["timings_s"]
    rows: list[tuple[str, str, str]] = [
        ("", "reference", "checkpoint + SIGKILL + restore"),
        ("rollouts", str(metrics["rollouts"]), str(metrics["rollouts"])),
        ("mean reward", _num(metrics["mean_reward_reference"]), _num(metrics["mean_reward_restored"])),
        ("rows identical", "-", f"{'yes' if metrics['identical_to_reference'] else 'NO'} "
                                f"({metrics['token_arrays_compared']} token arrays equal, max |logprob diff| "
                                f"{metrics['max_logprob_diff']:.1e})"),
        ("mesh start", f"{t['mesh_start_s']:.1f} s (one mesh for both)",
         f"restart after the crash {t['restart_s']:.1f} s"),
        ("collecting", f"{t['reference_collect_s']:.1f} s", f"{t['interrupted_collect_s']:.1f} s + "
                                                            f"{t['restored_collect_s']:.1f} s"),
        ("checkpoint", "-", f"{metrics['calls_in_flight_at_checkpoint']} model calls and "
                            f"{metrics['rollouts_in_flight']} rollouts in flight, "
                            f"{metrics['checkpoint_bytes'] / 1024:.1f} KiB"),
        ("pause", "-", f"{metrics['checkpoint_pause_ms']:.0f} ms until published"),
        ("crash", "-", f"SIGKILL to {len(metrics['servers_killed'])} servers, "
                       f"{metrics['rows_before_crash']} rows written"),
        ("restore", "-", f"{metrics['restored_episodes']} rollouts continued, "
                         f"{metrics['restarted_episodes']} started over, {metrics['restore_ms']:.0f} ms"),
        ("model calls skipped", "-", f"{metrics['continued_model_calls_skipped']} "
                                     f"({metrics['continued_tokens_skipped']} tokens not generated again)"),
        *_cut_rows(metrics),
        ("calls not cut", "-", f"{metrics['uncut_calls']} (held or not started): "
                               f"{metrics['tokens_regenerated_uncut']} tokens generated again"
                               f"{'' if metrics['tokens_regenerated_uncut_exact'] else ' (estimate)'}"),
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    return "\n".join(f"{a:<{widths[0]}}   {b:<{widths[1]}}   {c}" for a, b, c in rows)


def _cut_rows(metrics: dict[str, Any]) -> list[tuple[str, str, str]]:
    if not metrics["generation_cuts"]:
        return [("generation cuts", "-", "off (--no-generation-cuts)")]
    return [
        ("generation cuts", "-", f"{metrics['cut_calls']} calls cut mid-generation, "
                                 f"{metrics['cut_tokens_staged']} tokens staged"),
        ("tokens kept", "-", f"{metrics['tokens_kept']} served from staging, "
                             f"{metrics['tokens_regenerated']} generated again"),
        ("after the cut point", "-", f"{metrics['tokens_after_cut']} tokens (made between commit and crash) "
                                     "generated again"),
    ]


def _num(value: Any) -> str:
    return "-" if value is None else f"{value:.3f}"


